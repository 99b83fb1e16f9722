source benchmarks/_device_env.sh
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv
timeout 280 python3 benchmarks/runner_profile.py --profile --out $OUT/profile.md > $OUT/profile.log 2>&1; echo rc=$?
timeout 250 python3 benchmarks/runner_profile.py --gemm --out $OUT/gemm.md > $OUT/gemm.log 2>&1; echo rc=$?
tail -5 $OUT/profile.log; grep "^|" $OUT/gemm.log
