#!/usr/bin/env bash
# Builds what bench/h200_run.sh runs (build-h200/: the library, the msaidx and msaidx_ab tools, the
# gpu tests and their ctest files; Release, sm_90a) on a host without a GPU and packs it into one
# tarball, so that no device time goes to compiling. Carry the tarball's folder to the device,
# unpack it in the repository root there and leave the build steps out:
#   here:   PACK=build-pack/build.tgz bash bench/h200_pack.sh
#   device: tar xzf build-pack/build.tgz && SKIP="configure build" bash bench/h200_run.sh
# (the whole run takes more than one device call: split it with SKIP / ONLY as the current
# results/<date>_h200_full.md shows). The ctest files name this checkout's absolute paths, so
# `ctest -L gpu` there needs the device's copy at the same path, as the lent H200 has it.
set -euo pipefail
build=build-h200
pack=${PACK:-build-pack/build.tgz}
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j"$(nproc)"
# BASE=<commit>: that commit's msaidx CLI and library too (build-base/), for a same-run A/B
# without compiling on the device: `msaidx bench --backend persistent --no-ceilings --json F` of
# each CLI in the order A B B A, then bench/ab_compare.py; or the Python tools (bench/cp_bench.py
# --one-gpu) with MSAIDX_LIBRARY=build-base/libmsaidx.so against build-h200's.
base=()
if [ -n "${BASE:-}" ]; then
    # Built from scratch: git archive dates the files at the commit, which make would take
    # for older than the objects of another BASE built before.
    rm -rf build-base build-base-src && mkdir build-base-src
    git archive "$BASE" | tar x -C build-base-src
    cmake -S build-base-src -B build-base -DCMAKE_BUILD_TYPE=Release >/dev/null
    cmake --build build-base -j"$(nproc)" --target msaidx_cli msaidx
    base=(build-base/msaidx build-base/libmsaidx.so*)
fi
mkdir -p "$(dirname "$pack")"
tar czf "$pack" "$build"/libmsaidx.so* "$build"/msaidx "$build"/msaidx_ab \
    "$build"/CTestTestfile.cmake "$build"/tests/CTestTestfile.cmake "$build"/tests/gpu_* \
    "${base[@]}"
ls -l "$pack"
