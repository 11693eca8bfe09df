#!/usr/bin/env bash
# Same-run A/B of the persistent scorer: an older tree (e.g. `git archive 78b5ab1 | tar -x -C base`)
# against this one, on the 78 shapes at both precisions, old and new interleaved, ROUNDS times.
# Usage: bash bench/ab_run.sh BASE_TREE OUT_DIR NEW_BUILD_DIR [ROUNDS]
# Writes OUT_DIR/ab_{old,new}_{exact,fp8}_<round>.json. The base's CLI spells FP8 accumulation
# `--fast-accumulation` (before config.precision) and is exact by default; this tree's default is
# FP8 accumulation and `--precision exact` is exact.
set -u
base=$1 out=$2 new=$3 rounds=${4:-1}
mkdir -p "$out"
cmake -S "$base" -B /tmp/ab-old -DCMAKE_BUILD_TYPE=Release >/dev/null 2>&1 &&
    cmake --build /tmp/ab-old -j"$(nproc)" --target msaidx_cli >/dev/null 2>&1 ||
    { echo "ab: the base build failed"; exit 1; }
common=(bench --backend persistent --no-ceilings)
for round in $(seq "$rounds"); do
    (cd "$base" && /tmp/ab-old/msaidx "${common[@]}" --shapes bench/shapes/prefill78.tsv \
        --json "$out/ab_old_exact_$round.json" >/dev/null 2>&1)
    "$new/msaidx" "${common[@]}" --precision exact --json "$out/ab_new_exact_$round.json" >/dev/null 2>&1
    (cd "$base" && /tmp/ab-old/msaidx "${common[@]}" --fast-accumulation \
        --shapes bench/shapes/prefill78.tsv --json "$out/ab_old_fp8_$round.json" >/dev/null 2>&1)
    "$new/msaidx" "${common[@]}" --json "$out/ab_new_fp8_$round.json" >/dev/null 2>&1
    echo "ab: round $round done"
done
