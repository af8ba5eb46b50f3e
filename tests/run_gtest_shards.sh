#!/usr/bin/env bash
# Runs a GoogleTest binary as N shards in parallel (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX), one
# per core: the suite is mostly single-threaded, so on a 2-core machine this halves its time.
# Each shard's output is printed whole when the shard ends; the exit status is the first
# failing shard's (any failure fails the run).
#
#   tests/run_gtest_shards.sh N binary [gtest arguments...]
set -uo pipefail
shards="$1"
shift
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
pids=()
for ((i = 0; i < shards; ++i)); do
  GTEST_TOTAL_SHARDS="$shards" GTEST_SHARD_INDEX="$i" "$@" >"$logs/$i" 2>&1 &
  pids+=($!)
done
status=0
for ((i = 0; i < shards; ++i)); do
  wait "${pids[$i]}"
  rc=$?
  echo "== shard $((i + 1)) of $shards (exit $rc)"
  cat "$logs/$i"
  if [[ $rc -ne 0 && $status -eq 0 ]]; then status=$rc; fi
done
exit "$status"
