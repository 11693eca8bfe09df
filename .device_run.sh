# second device call: from .wt/fused; logs to $OUT
O=$OUT; B=/tmp/fused-build; S=$SECONDS
t() { echo "[$((SECONDS-S))s] $*" >> $O/summary.txt; }
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release > $O/cfg.log 2>&1; t cfg rc=$?
timeout 120 cmake --build $B -j16 --target msaidx msaidx_cli gpu_topk gpu_split_parity gpu_bad_metadata > $O/build.log 2>&1; t build rc=$?
timeout 90 env MSAIDX_LIBRARY=$B/libmsaidx.so PYTHONPATH=python python3 -m pytest -q -x tests/python/test_prefill_topk.py tests/python/test_torch.py tests/python/test_torch_ops.py tests/python/test_docs.py > $O/pytest.log 2>&1; t pytest rc=$? "$(tail -1 $O/pytest.log)"
(cd $B && timeout 75 ./msaidx e2e --fused --tp 1,4 --prefill 2048,8192 --context 32768,153600 --max-seconds 55 --json $O/e2e.json --markdown $O/e2e.md > $O/e2e.log 2>&1; t e2e rc=$? "$(tail -1 $O/e2e.log)")
(cd $B && timeout 40 ctest -L gpu -R "gpu_topk|gpu_split_parity|gpu_bad_metadata" > $O/ctest_gpu.log 2>&1; t ctest_gpu rc=$? "$(grep 'tests passed' $O/ctest_gpu.log)")
cat $O/summary.txt
