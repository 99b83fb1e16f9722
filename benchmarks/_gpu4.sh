source benchmarks/_device_env.sh
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_gemv.py tests/runtime/test_runner_cuda.py > $OUT/tests.log 2>&1; echo tests rc=$?; tail -3 $OUT/tests.log
for P in 1 0 gemv gemv,norm,rope,silu attn,reduce; do
KVSTRATA_PDL=$P timeout 100 python3 benchmarks/runner_bench.py --batches 1 --steps 24 --attn-contexts --contexts 1024 --out $OUT/pdl.md > $OUT/pdl.log 2>&1; echo "PDL=$P rc=$?"
grep "^| [a-z]" $OUT/pdl.md | cut -d'|' -f2,4,5,8
done
