#!/usr/bin/env bash
# Builds the libFuzzer targets fuzz-build/fuzz_rope, fuzz_fused and fuzz_table_free (clang++-14,
# ASan + UBSan; fuzz_fused covers qk_norm_rope and rope_and_cache_kv, fuzz_table_free the
# frequency form of the tables) from the library sources, mirroring the top-level
# CMakeLists.txt: one set of flags per kernel ISA directory, and ROME_HAVE_<ISA> for src/core/dispatch.cpp for each kernel directory that has sources.
#
#   fuzz/build.sh                 build (incremental: objects are rebuilt when a source is newer)
#   fuzz/build.sh run SECONDS     build, then fuzz for SECONDS (new inputs go to fuzz-build/corpus;
#                                 fuzz/corpus is only read), print executions and corpus size
#   fuzz/build.sh smoke           build, then a reproducible run for make test: a fresh corpus from
#                                 fuzz/corpus, a fixed seed and a fixed number of inputs
#                                 (FUZZ_SEED, FUZZ_RUNS; capped at 75 s, which a slow machine may
#                                 reach: 4000 fuzz_rope inputs took about 60 s here), so CI and a
#                                 developer's machine fuzz the same inputs
#   fuzz/build.sh corpus          rebuild fuzz/corpus with fuzz/make_corpus.cpp
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/fuzz-build"
mkdir -p "$out/obj"
CXX="${CXX:-clang++-14}"
common=(-std=c++20 -gline-tables-only -O1 -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined
        -fno-sanitize-recover=undefined -I"$root/include" -I"$root/src")
# SIMD kernels: ASan (and coverage) without UBSan, and at -O0. With UBSan, or with ASan at -O1 or
# -O2, clang-14 takes minutes on the intrinsics-heavy AVX-512 kernel file (184 s at -O1 against
# 9 s at -O0); UBSan still covers the core and the scalar kernel.
simd=(-std=c++20 -gline-tables-only -O0 -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address
      -I"$root/include" -I"$root/src")
# The harness (model, references, comparisons) is checked by ASan/UBSan but not coverage
# instrumented: coverage guidance comes from the library, and the harness runs 3x faster.
harness=(-std=c++20 -g -O2 -fno-omit-frame-pointer -fsanitize=address,undefined
         -fno-sanitize-recover=undefined -I"$root/include" -I"$root/src")
avx2=(-mavx2 -mfma -mf16c -mbmi2)
avx512=("${avx2[@]}" -mavx512f -mavx512bw -mavx512vl -mavx512dq)
amx=("${avx512[@]}" -mavx512bf16 -mamx-tile -mamx-bf16)

objects=()
defines=()
# Objects compile in the background, one per core; wait_compiles collects them (any failure
# stops the build) before a link.
max_jobs="$(nproc)"
compile_pids=()
wait_compiles() {
  local pid
  for pid in "${compile_pids[@]}"; do wait "$pid"; done
  compile_pids=()
}
compile() {  # source, extra flags...
  local src="$1"; shift
  local flags=("${common[@]}")
  if [[ "${1:-}" == --harness ]]; then flags=("${harness[@]}"); shift; fi
  if [[ "${1:-}" == --simd ]]; then flags=("${simd[@]}"); shift; fi
  local obj="$out/obj/$(echo "${src#$root/}" | tr '/' '_').o"
  # Rebuild when the source or any header under include/ src/ fuzz/ is newer than the object.
  if [[ ! -f "$obj" || "$src" -nt "$obj" || "$root/fuzz/build.sh" -nt "$obj" ]] || [[ -n "$(find "$root/include" "$root/src" "$root/fuzz" -name '*.hpp' -newer "$obj" -print -quit)" ]]; then
    echo "  CXX $src"
    while (( $(jobs -rp | wc -l) >= max_jobs )); do sleep 0.2; done
    "$CXX" "${flags[@]}" "$@" -c "$src" -o "$obj" &
    compile_pids+=($!)
  fi
  objects+=("$obj")
}

for isa in scalar avx2 avx512 amx; do
  shopt -s nullglob
  srcs=("$root"/src/kernels/$isa/*.cpp)
  shopt -u nullglob
  [[ ${#srcs[@]} -eq 0 ]] && continue
  case $isa in
    scalar) flags=() ;;
    avx2) flags=(--simd "${avx2[@]}") ;;
    avx512) flags=(--simd "${avx512[@]}") ;;
    amx) flags=(--simd "${amx[@]}") ;;
  esac
  for s in "${srcs[@]}"; do compile "$s" "${flags[@]}"; done
  defines+=("-DROME_HAVE_${isa^^}")
done
# The core depends on which kernel libraries exist: rebuild it when that set changes.
stamp="$out/obj/defines.txt"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "${defines[*]}" ]]; then
  rm -f "$out"/obj/src_core_*.o
  echo "${defines[*]}" > "$stamp"
fi
for s in "$root"/src/core/*.cpp; do compile "$s" "${defines[@]}"; done
library=("${objects[@]}")
targets=(fuzz_rope fuzz_fused fuzz_table_free)
for target in "${targets[@]}"; do compile "$root/fuzz/$target.cpp" --harness; done
wait_compiles
for target in "${targets[@]}"; do
  "$CXX" -fsanitize=fuzzer,address,undefined "${library[@]}" "$out/obj/fuzz_$target.cpp.o" -lpthread \
    -o "$out/$target"
done
echo "built $out/fuzz_rope, $out/fuzz_fused and $out/fuzz_table_free (kernels: scalar ${defines[*]})"

# Runs fuzz-build/NAME for at most SECONDS on CORPUS (then the read-only corpus directories
# given after it); in smoke mode from an empty CORPUS with a fixed seed and RUNS inputs. Prints
# the outcome counts the target logs (ROME_FUZZ_STATS), or the failure, and stops on one.
fuzz_target() {  # mode name seconds max_len runs corpus [read-only corpus...]
  local mode="$1" name="$2" seconds="$3" max_len="$4" runs="$5" corpus="$6"
  shift 6
  local limits=() log status execs
  if [[ "$mode" == smoke ]]; then
    rm -rf "$corpus"
    limits=(-seed="${FUZZ_SEED:-1}" -runs="$runs")
  fi
  mkdir -p "$corpus"
  log="$out/$name-$(date +%Y%m%d-%H%M%S).log"
  echo "$name: $mode for at most ${seconds}s ${limits[*]} (ROME_FUZZ_SKIP='${ROME_FUZZ_SKIP:-}'), log $log"
  set +e
  ( cd "$out" && ROME_FUZZ_STATS=1 "./$name" -max_total_time="$seconds" -max_len="$max_len" \
      -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 "${limits[@]}" "$corpus" "$@" ) > "$log" 2>&1
  status=$?
  set -e
  if [[ $status -ne 0 ]]; then
    grep -v '^#[0-9]' "$log" | tail -n 80
    echo "$name: FAILED (exit $status); the input is in $out/crash-* (rerun: $out/$name FILE)"
    exit $status
  fi
  { grep -E '^ +[0-9]+  ' "$log" || true; } | sort -rn | head -n 40  # outcomes and errors, by count
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo '?')
  echo "$name: $execs executions in at most ${seconds}s; corpus ${corpus#$root/} $(ls "$corpus" | wc -l) files"
}

case "${1:-}" in
  run|smoke)
    if [[ "$1" == smoke ]]; then
      seconds=75
      corpus="$out/smoke-corpus"
    else
      seconds="${2:-60}"
      corpus="$out/corpus"
    fi
    # A libFuzzer process runs on one core: fuzz_rope runs beside the other two (the fused passes
    # and table-free RoPE, a fifth of the time each, from an empty corpus), each output printed
    # whole when its run ends.
    other_seconds=$(( seconds / 5 > 10 ? seconds / 5 : 10 ))
    fuzz_target "$1" fuzz_rope "$seconds" 4096 "${FUZZ_RUNS:-4000}" "$corpus" "$root/fuzz/corpus" \
      > "$out/fuzz_rope.summary" 2>&1 &
    rope_pid=$!
    others_status=0
    ( fuzz_target "$1" fuzz_fused "$other_seconds" 256 "${FUZZ_FUSED_RUNS:-20000}" "$corpus-fused"
      fuzz_target "$1" fuzz_table_free "$other_seconds" 512 "${FUZZ_TABLE_FREE_RUNS:-20000}" \
        "$corpus-table-free" ) || others_status=$?
    rope_status=0
    wait "$rope_pid" || rope_status=$?
    cat "$out/fuzz_rope.summary"
    (( rope_status == 0 && others_status == 0 )) || exit 1 ;;
  corpus)
    "$CXX" -std=c++20 -O1 "$root/fuzz/make_corpus.cpp" -o "$out/make_corpus"
    mkdir -p "$root/fuzz/corpus" && rm -f "$root"/fuzz/corpus/seed-*  # keep regression-* inputs
    "$out/make_corpus" "$root/fuzz/corpus"
    echo "fuzz/corpus: $(ls "$root/fuzz/corpus" | wc -l) files, $(cat "$root"/fuzz/corpus/* | wc -c) bytes" ;;
esac
