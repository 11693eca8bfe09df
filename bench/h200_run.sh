#!/usr/bin/env bash
# The H200 verification + benchmark run behind bench/results/<date>_h200_*: build, the gpu tests,
# the Python suite on torch tensors, compute-sanitizer, accuracy, the 78-shape bench at both
# precisions and on BF16, the decode grid, index preparation, e2e. Each step has a time limit; the
# whole run takes about 15 minutes on a machine that starts cold, more than one device call's 10,
# so it is split into two calls with SKIP (as bench/results/<date>_h200_full.md shows). A one-line
# result per step goes to summary.txt as it finishes. Files under ${OUT:-bench/out}: summary.txt, steps.log (every step's
# full output), bench.{json,md} (E4M3, default precision: FP8 accumulation on persistent),
# bench_exact.*, bench_read_flush.* (persistent after a read flush), bench_bf16.*, decode.*,
# index_prepare.json, e2e.*, e2e_pitch8192.*, and with AB_BASE set ab_{fp8,exact}.json (the A/B against that tree). On the device,
# `PACK=$OUT/run.tgz OUT=/tmp/r bash bench/h200_run.sh` (PACK first, so that it reads the device's
# $OUT) brings back every finished step even when the call's time limit cuts the run short;
# SKIP="racecheck_graph e2e" leaves steps out by name, ONLY="pytest e2e" runs only those.
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
    # SKIP="name name ...": steps left out when the device budget is short; ONLY="name ...": the
    # steps run, the others left out (a second call finishing a run). Both listed as skipped.
    if [[ " ${SKIP:-} " == *" $name "* ]] || [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]]; then
        printf '%-18s skipped\n' "$name" | tee -a "$summary"
        return
    fi
    local start=$SECONDS step_log
    step_log=$(mktemp)
    timeout "$limit" "$@" >"$step_log" 2>&1
    local rc=$?
    { echo "===== $name: $*"; cat "$step_log"; echo "===== $name rc=$rc"; } >>"$log"
    printf '%-18s rc=%-3d %4ds | %s\n' "$name" "$rc" $((SECONDS - start)) \
        "$(grep -v '^\s*$' "$step_log" | tail -n 1)" | tee -a "$summary"
    rm -f "$step_log"
    # A device call returns only a few files, and none of a step it cut short: with PACK set,
    # every finished step refreshes one tarball of everything so far.
    if [ -n "${PACK:-}" ]; then tar czf "$PACK.tmp" -C "$out" . && mv "$PACK.tmp" "$PACK"; fi
}

echo "commit ${COMMIT:-unknown}, $(date -u +%FT%TZ)" | tee -a "$summary"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader | tee -a "$summary"
step configure 120 cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release
step build 300 cmake --build "$build" -j16
step ctest_gpu 480 bash -c "cd $build && ctest -L gpu --output-on-failure"
step pytest 300 env MSAIDX_LIBRARY="$build/libmsaidx.so" PYTHONPATH=python python3 -m pytest -q tests/python
step fuzz_python_cuda 120 env MSAIDX_LIBRARY="$build/libmsaidx.so" PYTHONPATH=python python3 -W ignore::RuntimeWarning tests/python/fuzz_api.py --device cuda --seconds 60
# The sanitizers: top-k, bad and fuzzed metadata (rewritten after planning too), graph replay,
# the persistent scorer at both precisions and on BF16, index preparation, context parallel.
step memcheck_topk 90 env MSAIDX_TEST_ROUNDS=10 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_topk"
step racecheck_topk 90 env MSAIDX_TEST_ROUNDS=5 compute-sanitizer --tool racecheck --error-exitcode 1 "$build/tests/gpu_topk"
step memcheck_badmeta 120 env MSAIDX_TEST_SMALL=1 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_bad_metadata"
step memcheck_fuzzmeta 120 env MSAIDX_TEST_ROUNDS=2 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_fuzz_metadata"
step racecheck_graph 120 compute-sanitizer --tool racecheck --error-exitcode 1 "$build/tests/gpu_graph"
persistent_run=(run --backend persistent --q-lens 1,300,129,700 --kv-lens 5000,1300,129,9000 --page-pad 48 --repeat 1)
step memcheck_e4m3 90 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/msaidx" "${persistent_run[@]}"
step racecheck_e4m3 90 compute-sanitizer --tool racecheck --error-exitcode 1 "$build/msaidx" "${persistent_run[@]}"
step memcheck_exact 90 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/msaidx" "${persistent_run[@]}" --precision exact
step memcheck_bf16 90 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/msaidx" "${persistent_run[@]}" --dtype bf16
step memcheck_prepare 60 env MSAIDX_TEST_SMALL=1 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_index_prepare"
step memcheck_prefill_topk 180 env MSAIDX_TEST_ROUNDS=3 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_prefill_topk"
step racecheck_prefill_topk 90 env MSAIDX_TEST_ROUNDS=2 MSAIDX_TEST_SMALL=1 compute-sanitizer --tool racecheck --error-exitcode 1 "$build/tests/gpu_prefill_topk"
step memcheck_context_parallel 120 env MSAIDX_TEST_ROUNDS=1 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_context_parallel"
step memcheck_shared_plan 60 compute-sanitizer --tool memcheck --error-exitcode 1 "$build/tests/gpu_shared_plan"
step check 120 "$build/msaidx" check --seed 1
step check_exact 120 "$build/msaidx" check --seed 1 --precision exact
step sass 60 bash bench/sass_summary.sh "$build/libmsaidx.so" score
step wgmma_as_written 60 cmake -DBINARY="$build/libmsaidx.so" -P tests/persistent_wgmma.cmake
# With AB_BASE (a `git archive` of an older commit): the persistent scorer of that tree's library
# against this one's, both loaded into one msaidx_ab process (bench/ab_dlopen.c), on the 78 shapes.
if [ -n "${AB_BASE:-}" ]; then
    step ab_build 240 bash -c "cmake -S '$AB_BASE' -B /tmp/ab-base -DCMAKE_BUILD_TYPE=Release >/dev/null && cmake --build /tmp/ab-base -j16 --target msaidx >/dev/null"
    step ab_fp8 150 "$build/msaidx_ab" /tmp/ab-base/libmsaidx.so "$build/libmsaidx.so" --precision fp8 --repeat 30 --json "$out/ab_fp8.json"
    step ab_exact 150 "$build/msaidx_ab" /tmp/ab-base/libmsaidx.so "$build/libmsaidx.so" --precision exact --repeat 20 --json "$out/ab_exact.json"
fi
# Speed: the 78 shapes at the default precision (the headline), exact, and BF16; the decode grid;
# index preparation against a copy and torch; last, as the longest, the e2e grid.
step bench 200 "$build/msaidx" bench --max-seconds 150 --json "$out/bench.json" --markdown "$out/bench.md"
step bench_exact 200 "$build/msaidx" bench --precision exact --max-seconds 150 --json "$out/bench_exact.json" --markdown "$out/bench_exact.md"
step bench_read_flush 120 "$build/msaidx" bench --backend persistent --flush read --no-ceilings --max-seconds 60 --json "$out/bench_read_flush.json" --markdown "$out/bench_read_flush.md"
step bench_bf16 200 "$build/msaidx" bench --dtype bf16 --max-seconds 150 --json "$out/bench_bf16.json" --markdown "$out/bench_bf16.md"
step bench_decode 200 "$build/msaidx" bench --decode --json "$out/decode.json" --markdown "$out/decode.md"
step bench_prepare 150 env MSAIDX_LIBRARY="$build/libmsaidx.so" PYTHONPATH=python python3 bench/index_prepare_torch.py --cos-sin fp32,theta --json "$out/index_prepare.json"
step e2e 420 "$build/msaidx" e2e --fused --max-config-seconds 20 --max-seconds 300 --json "$out/e2e.json" --markdown "$out/e2e.md"
# The engine step under score rows sized for 1M tokens (vLLM's 8192 pages) at short contexts.
step e2e_pitch8192 60 "$build/msaidx" e2e --pitch 8192 --backends auto --tp 1,4 --context 8192,32768,153600 --prefill 512,2048,8192 --json "$out/e2e_pitch8192.json" --markdown "$out/e2e_pitch8192.md"
