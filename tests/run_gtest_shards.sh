#!/usr/bin/env bash
# Runs a GoogleTest binary as 4·N shards (GTEST_TOTAL_SHARDS / GTEST_SHARD_INDEX), at most N at a
# time (one per core: the suite is mostly single-threaded). GoogleTest deals the tests out round
# robin, so a few slow tests can make one shard of N take twice as long as another; with four
# shards per core a core that finishes early takes the next shard instead of idling.
# Each shard's output is printed whole, in shard order; the exit status is the first failing
# shard's (any failure fails the run).
#
#   tests/run_gtest_shards.sh N binary [gtest arguments...]
set -uo pipefail
workers="$1"
shift
shards=$((4 * workers))
logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
declare -A shard_of_pid
declare -a rc_of_shard
running=0
reap_one() {
  local pid rc
  wait -n -p pid
  rc=$?
  rc_of_shard[${shard_of_pid[$pid]}]=$rc
  running=$((running - 1))
}
for ((i = 0; i < shards; ++i)); do
  if ((running >= workers)); then reap_one; fi
  GTEST_TOTAL_SHARDS="$shards" GTEST_SHARD_INDEX="$i" "$@" >"$logs/$i" 2>&1 &
  shard_of_pid[$!]=$i
  running=$((running + 1))
done
while ((running > 0)); do reap_one; done
status=0
for ((i = 0; i < shards; ++i)); do
  rc=${rc_of_shard[$i]}
  echo "== shard $((i + 1)) of $shards (exit $rc)"
  cat "$logs/$i"
  if [[ $rc -ne 0 && $status -eq 0 ]]; then status=$rc; fi
done
exit "$status"
