source benchmarks/_device_env.sh
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
python3 -c "import triton,torch; print('triton', triton.__version__, 'torch', torch.__version__); from kvstrata.kernels._device import pdl_ok; print('pdl', pdl_ok(torch.device('cuda')))"
timeout 200 python3 -m pytest -q -x -p no:cacheprovider -m gpu tests/kernels/test_gemv.py tests/kernels/test_layer_ops.py tests/runtime/test_runner_cuda.py > $OUT/tests.log 2>&1; echo tests rc=$?; tail -3 $OUT/tests.log
timeout 150 python3 benchmarks/runner_bench.py --batches 1 --steps 16 --attn-contexts --out $OUT/b1.md > $OUT/b1.log 2>&1; echo b1 rc=$?
grep "^|" $OUT/b1.md
KVSTRATA_PDL=0 timeout 150 python3 benchmarks/runner_bench.py --batches 1 --steps 16 --attn-contexts --contexts 1024 --out $OUT/b1_nopdl.md > $OUT/b1_nopdl.log 2>&1; echo nopdl rc=$?
grep "^|" $OUT/b1_nopdl.md
timeout 120 python3 benchmarks/runner_profile.py --profile --contexts 1024 --out $OUT/profile.md > $OUT/profile.log 2>&1; echo prof rc=$?
