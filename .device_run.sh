# run from .wt/fused on the device; logs to $OUT
O=$OUT; B=/tmp/fused-build; S=$SECONDS
t() { echo "[$((SECONDS-S))s] $*" >> $O/summary.txt; }
git log --oneline -1 > $O/commit.txt 2>&1; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> $O/commit.txt
cmake -S . -B $B -DCMAKE_BUILD_TYPE=Release > $O/cfg.log 2>&1; t cfg rc=$?
timeout 170 cmake --build $B -j16 --target msaidx_cli gpu_prefill_topk gpu_graph > $O/build.log 2>&1; t build rc=$?
(cd $B && timeout 45 ./tests/gpu_prefill_topk > $O/gpu_prefill_topk.log 2>&1; t gpu_prefill_topk rc=$? "$(tail -1 $O/gpu_prefill_topk.log)")
(cd $B && timeout 100 ./msaidx bench --backend persistent --max-seconds 80 --json $O/bench.json --markdown $O/bench.md > $O/bench.log 2>&1; t bench rc=$?)
(cd $B && timeout 30 ./tests/gpu_graph > $O/gpu_graph.log 2>&1; t gpu_graph rc=$? "$(tail -1 $O/gpu_graph.log)")
(cd $B && MSAIDX_TEST_ROUNDS=2 timeout 40 compute-sanitizer --tool memcheck --error-exitcode 1 ./tests/gpu_prefill_topk > $O/memcheck.log 2>&1; t memcheck rc=$? "$(tail -1 $O/memcheck.log)")
(cd $B && MSAIDX_TEST_ROUNDS=1 timeout 40 compute-sanitizer --tool racecheck --error-exitcode 1 ./tests/gpu_prefill_topk > $O/racecheck.log 2>&1; t racecheck rc=$? "$(tail -1 $O/racecheck.log)")
cat $O/summary.txt
