source benchmarks/_device_env.sh
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
timeout 100 python3 benchmarks/runner_profile.py --gemm --out $OUT/gemm.md > $OUT/gemm.log 2>&1; echo gemm rc=$?
grep "^|" $OUT/gemm.md
timeout 150 python3 benchmarks/runner_bench.py --batches 1 --steps 16 --attn-contexts --no-fuse --out $OUT/b1_nofuse.md > $OUT/b1_nofuse.log 2>&1; echo b1 rc=$?
grep "^|" $OUT/b1_nofuse.md
KVSTRATA_PDL=0 timeout 150 python3 benchmarks/runner_bench.py --batches 1 --steps 16 --attn-contexts --contexts 1024 --no-fuse --out $OUT/b1_nofuse_nopdl.md > $OUT/b1_nofuse_nopdl.log 2>&1; echo nopdl rc=$?
grep "^|" $OUT/b1_nofuse_nopdl.md
timeout 120 python3 benchmarks/runner_profile.py --profile --no-fuse --contexts 1024 --out $OUT/profile.md > $OUT/profile.log 2>&1; echo prof rc=$?
