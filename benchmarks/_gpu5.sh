source benchmarks/_device_env.sh
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
KVSTRATA_PDL=0 timeout 100 python3 benchmarks/runner_bench.py --batches 1 --steps 24 --attn-contexts --out $OUT/b1_nopdl.md > $OUT/b1_nopdl.log 2>&1; echo "nopdl rc=$?"
grep "^| [a-z]" $OUT/b1_nopdl.md | cut -d'|' -f2,4,5,8
bash benchmarks/gpu_runner.sh tests bench peer e2e
