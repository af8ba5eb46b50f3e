# make bench: install what is missing, build, run the main benchmark.
# make test:  install what is missing, build, run every test (C++ also under ASan + UBSan).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

JOBS ?= $(shell nproc)
VENV := .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip
# PIC so that the Python extension links build/librome.a instead of compiling the library again.
CMAKE_FLAGS := -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_POSITION_INDEPENDENT_CODE=ON
APT_PACKAGES := cmake ninja-build g++ python3-venv python3-dev libgtest-dev libgmock-dev \
                libbenchmark-dev clang-14 libclang-rt-14-dev clang-format-14
STAMPS := .stamps
# Run as root (CI, fresh machines here) or through sudo.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: deps venv build build-asan python test test-cpp test-isa test-asan test-python \
        fuzz-smoke fuzz tsan bench bench-cpp format clean

deps: $(STAMPS)/apt
$(STAMPS)/apt:
	@mkdir -p $(STAMPS)
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  echo "installing: $$missing"; \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq $$missing >/dev/null; \
	fi
	@touch $@

# torch is pinned through constraints.txt: never another version (it would pull CUDA packages).
venv: $(STAMPS)/venv
$(STAMPS)/venv: requirements/dev.txt requirements/constraints.txt | $(STAMPS)/apt
	@[ -x $(PYTHON) ] || python3 -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check -c requirements/constraints.txt -r requirements/dev.txt
	@touch $@

build: deps
	cmake -S . -B build $(CMAKE_FLAGS) >/dev/null
	cmake --build build -j $(JOBS)

# -O1 and line tables only (-g1: reports still name file and line): at -O2 -g the sanitizers'
# instrumentation made this build take 5.4 minutes on 2 cores (the AVX-512 kernel file alone
# 150 s), and the suite runs about as fast at -O1 (241 s of test time against 226 s).
build-asan: deps
	cmake -S . -B build-asan $(CMAKE_FLAGS) -DCMAKE_BUILD_TYPE=RelWithDebInfo \
	  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g1 -DNDEBUG" -DROME_SANITIZE=ON -DROME_BUILD_BENCH=OFF >/dev/null
	cmake --build build-asan -j $(JOBS)

# The extension links the Release build's librome.a (PIC); on its own, setup.py builds the
# library into build/py with CMake.
python: build $(STAMPS)/python
$(STAMPS)/python: $(STAMPS)/venv build/librome.a $(shell find src include bindings python -type f 2>/dev/null) setup.py CMakeLists.txt
	ROME_CORE_LIBRARY=build/librome.a $(PIP) install -q --no-build-isolation --no-deps -c requirements/constraints.txt -e .
	@touch $@

# The .venv install (mostly one core unpacking wheels) runs beside the Release build; then the
# test stages run one after another.
test:
	$(MAKE) --no-print-directory -j 2 --output-sync=target build venv
	$(MAKE) --no-print-directory test-cpp test-isa test-asan fuzz-smoke test-python

# The GoogleTest suites run as four shards per core, one per core at a time (tests/run_gtest_shards.sh).
test-cpp: build
	bash tests/run_gtest_shards.sh $(JOBS) ./build/rome_tests --gtest_brief=1
	./build/rome_example

# The same binary with ROME_MAX_ISA set to every ISA: the environment variable path, and the
# whole suite again on the lower ISAs (the suite already runs each ISA in-process too). An ISA
# this CPU lacks is skipped with the reason (ROME_MAX_ISA only lowers: it would rerun a lower one).
test-isa: build
	@for isa in scalar avx2 avx512 amx; do \
	  echo "== ROME_MAX_ISA=$$isa"; \
	  example=$$(ROME_MAX_ISA=$$isa ./build/rome_example); \
	  echo "$$example"; \
	  if [[ "$$example" != *" on $$isa" ]]; then \
	    echo "skipped: this CPU has no $$isa (rome_example ran on $${example##* on })"; \
	    continue; \
	  fi; \
	  ROME_MAX_ISA=$$isa bash tests/run_gtest_shards.sh $(JOBS) ./build/rome_tests --gtest_brief=1 \
	    --gtest_filter='*Simd*:RopeQK*:Backward*:Validation*'; \
	done

# Fewer random SIMD-vs-scalar cases than test-cpp (600 of 2500), and the heaviest value checks on
# smaller inputs (kSanitized, tests/cpp/isa_testing.hpp): test-cpp checks every value at full size;
# here the sanitizers look for memory errors on the same paths, at four times the cost per case.
test-asan: build-asan
	ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ROME_SIMD_CASES=600 \
	  bash tests/run_gtest_shards.sh $(JOBS) \
	  ./build-asan/rome_tests --gtest_brief=1 --gtest_filter='-Huge*'
	./build-asan/rome_example

# libFuzzer (clang-14) over rope_forward / rope_backward, the fused passes and table-free RoPE:
# in make test a reproducible run (fixed seed and input counts; fuzz_rope, at most 75 s, beside the
# other two, at most 15 + 15 s); make fuzz
# explores at random for FUZZ_SECONDS.
fuzz-smoke: deps
	bash fuzz/build.sh smoke

fuzz: deps
	bash fuzz/build.sh run $${FUZZ_SECONDS:-600}

# ThreadSanitizer build of the concurrency tests (not part of make test: about a minute more).
tsan: deps
	cmake -S . -B build-tsan $(CMAKE_FLAGS) -DCMAKE_BUILD_TYPE=RelWithDebInfo -DROME_TSAN=ON -DROME_BUILD_BENCH=OFF >/dev/null
	cmake --build build-tsan -j $(JOBS) --target rome_tests
	TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 ./build-tsan/rome_tests --gtest_filter='Concurrency*' --gtest_repeat=2

# One pytest worker per core, a whole file at a time (--dist loadfile): the module and session
# fixtures (a benchmark run, a zoo of tiny models) are then built once, not once per worker.
# (--dist loadgroup with xdist_group marks did not group anything under pytest 9.2 + xdist 3.8:
# the benchmark ran on both workers.)
# Idle OpenMP threads sleep instead of spinning: the workers and the benchmark test's subprocess
# share the cores, and spinning threads of one process starved the others (3x slower).
test-python: python
	OMP_WAIT_POLICY=PASSIVE $(PYTHON) -m pytest -q -rs -n $(JOBS) --dist loadfile tests/python

bench: build python
	$(PYTHON) -m rome.bench $(BENCH_ARGS)

bench-cpp: build
	./build/rome_bench $(BENCH_ARGS)

format:
	clang-format-14 -i $$(git ls-files '*.cpp' '*.hpp' '*.h')

clean:
	rm -rf build build-asan build-tsan build/py fuzz-build $(STAMPS) bench-results
