#!/usr/bin/env bash
# The H200 verification + benchmark run behind bench/results/<date>_h200_<version>_*: build, the gpu
# tests, the Python suite on torch tensors, bench, e2e, compute-sanitizer, check. Each step has a
# time limit so that the whole run fits one device call; a one-line result per step goes to
# summary.txt as it finishes. Files under ${OUT:-bench/out}: summary.txt, steps.log (every
# step's full output), bench.{json,md}, e2e.{json,md}, and the same with fast accumulation
# (bench_fast.*, e2e_fast.*).
set -uo pipefail
out=${OUT:-bench/out}
build=build-h200
mkdir -p "$out"
summary=$out/summary.txt log=$out/steps.log
: >"$summary"
: >"$log"

step() { # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS step_log
    step_log=$(mktemp)
    timeout "$limit" "$@" >"$step_log" 2>&1
    local rc=$?
    { echo "===== $name: $*"; cat "$step_log"; echo "===== $name rc=$rc"; } >>"$log"
    printf '%-18s rc=%-3d %4ds | %s\n' "$name" "$rc" $((SECONDS - start)) \
        "$(grep -v '^\s*$' "$step_log" | tail -n 1)" | tee -a "$summary"
    rm -f "$step_log"
}

echo "commit ${COMMIT:-unknown}, $(date -u +%FT%TZ)" | tee -a "$summary"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee -a "$summary"
step configure 120 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
step build 300 cmake --build "$build" -j16
step ctest_gpu 200 bash -c "cd $build && ctest -L gpu --output-on-failure"
step bench 200 "$build/msaidx" bench --max-seconds 150 --json "$out/bench.json" --markdown "$out/bench.md"
step pytest 120 env MSAIDX_LIBRARY="$build/libmsaidx.so" PYTHONPATH=python python3 -m pytest -q tests/python
step memcheck_topk 90 env MSAIDX_TEST_ROUNDS=15 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_topk"
step racecheck_topk 90 env MSAIDX_TEST_ROUNDS=10 compute-sanitizer --tool racecheck --error-exitcode 1 "$build/tests/gpu_topk"
step memcheck_badmeta 120 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_bad_metadata"
step memcheck_fuzzmeta 180 env MSAIDX_TEST_ROUNDS=3 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_fuzz_metadata"
step racecheck_graph 120 compute-sanitizer --tool racecheck --error-exitcode 1 "$build/tests/gpu_graph"
step check 120 "$build/msaidx" check --seed 1
# The opt-in FP8 tensor-core accumulation (persistent uses it; dense and split stay exact): the
# 78-shape bench with ceilings again, its accuracy,
# the sanitizers on its kernel, and the SASS of both scorers (FP16 HGMMA vs FP8 QGMMA, no spills).
step bench_fast 200 "$build/msaidx" bench --fast-accumulation --max-seconds 150 --json "$out/bench_fast.json" --markdown "$out/bench_fast.md"
step check_fast 120 "$build/msaidx" check --seed 1 --fast-accumulation
step memcheck_fast 90 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/msaidx" run --backend persistent --fast-accumulation --q-lens 1,300,129,700 --kv-lens 5000,1300,129,9000 --page-pad 48 --repeat 1
step racecheck_fast 90 compute-sanitizer --tool racecheck --error-exitcode 1 "$build/msaidx" run --backend persistent --fast-accumulation --q-lens 1,300,129,700 --kv-lens 5000,1300,129,9000 --page-pad 48 --repeat 1
step sass 60 bash bench/sass_summary.sh "$build/libmsaidx.so" score
# Index Q/K preparation: memcheck over bad slots and positions, then its bandwidth vs copy and torch.
step memcheck_prepare 60 env MSAIDX_TEST_SMALL=1 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_index_prepare"
step bench_prepare 90 env MSAIDX_LIBRARY="$build/libmsaidx.so" PYTHONPATH=python python3 bench/index_prepare_torch.py --json "$out/index_prepare.json"
# Last, as the longest: the whole TP x prefill x context grid, each config under 25 s.
step e2e 150 "$build/msaidx" e2e --max-config-seconds 25 --max-seconds 120 --json "$out/e2e.json" --markdown "$out/e2e.md"
step e2e_fast 150 "$build/msaidx" e2e --fast-accumulation --max-config-seconds 25 --max-seconds 100 --json "$out/e2e_fast.json" --markdown "$out/e2e_fast.md"
