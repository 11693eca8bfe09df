# Top-level entry points: `make` builds, `make run` runs the main job, `make test` runs everything.
BUILD ?= build
SAN_BUILD ?= build-san
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PYTHON ?= python3
CMAKE_FLAGS ?=

.PHONY: all build run test test-c test-sanitize test-python clean

all: build

build:
	cmake -S . -B $(BUILD) -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS) >/dev/null
	cmake --build $(BUILD) -j $(JOBS)

run: build
	./$(BUILD)/msaidx run

test: test-c test-sanitize test-python

test-c: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The host tests again under AddressSanitizer + UndefinedBehaviorSanitizer (cpu backend only).
test-sanitize:
	cmake -S . -B $(SAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DMSAIDX_CUDA=OFF -DMSAIDX_SANITIZE=ON >/dev/null
	cmake --build $(SAN_BUILD) -j $(JOBS)
	cd $(SAN_BUILD) && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
		ctest --output-on-failure -j $(JOBS) -L cpu

test-python: build
	PYTHONPATH=python $(PYTHON) -m pytest -q tests/python

clean:
	rm -rf $(BUILD) $(SAN_BUILD)

# C/CUDA formatting against .clang-format, without changing any file (`make format` applies it).
FORMAT_FILES ?= $(shell git ls-files src include tools tests examples | grep -E '\.(c|h|cu|cuh)$$')
CLANG_FORMAT ?= clang-format

.PHONY: format-check format
format-check:
	$(CLANG_FORMAT) --dry-run -Werror $(FORMAT_FILES)
format:
	$(CLANG_FORMAT) -i $(FORMAT_FILES)

# The API fuzzer's seeded loop (tests/fuzz/README.md) under ASan + UBSan, in the sanitizer build:
# one process per job, each for FUZZ_SECONDS, with fresh seeds (printed for replay). Then the
# Python API fuzzer for PY_FUZZ_SECONDS against the same build's library, with ASan's runtime
# preloaded into python so that a C read or write past an array Python passed is reported.
FUZZ_SECONDS ?= 100
PY_FUZZ_SECONDS ?= 60
.PHONY: fuzz fuzz-c fuzz-python
fuzz: fuzz-c fuzz-python

fuzz-c:
	cmake -S . -B $(SAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DMSAIDX_CUDA=OFF -DMSAIDX_SANITIZE=ON -DMSAIDX_FUZZ=ON >/dev/null
	cmake --build $(SAN_BUILD) -j $(JOBS) --target fuzz_api
	cd $(SAN_BUILD) && pids= && for i in $$(seq $(JOBS)); do \
		ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
		./tests/fuzz/fuzz_api --seconds $(FUZZ_SECONDS) & pids="$$pids $$!"; done; \
		status=0; for pid in $$pids; do wait $$pid || status=1; done; exit $$status

fuzz-python:
	cmake -S . -B $(SAN_BUILD) -DCMAKE_BUILD_TYPE=Debug -DMSAIDX_CUDA=OFF -DMSAIDX_SANITIZE=ON -DMSAIDX_FUZZ=ON >/dev/null
	cmake --build $(SAN_BUILD) -j $(JOBS) --target msaidx
	@asan=$$($(CC) -print-file-name=libasan.so); \
	if [ ! -f "$$asan" ]; then echo "fuzz-python: $(CC) has no libasan.so to preload: skipped"; exit 0; fi; \
	LD_PRELOAD=$$asan ASAN_OPTIONS=detect_leaks=0:verify_asan_link_order=0 UBSAN_OPTIONS=print_stacktrace=1 \
		MSAIDX_LIBRARY=$(abspath $(SAN_BUILD))/libmsaidx.so PYTHONPATH=python \
		$(PYTHON) -W ignore::RuntimeWarning tests/python/fuzz_api.py --seconds $(PY_FUZZ_SECONDS)
