#!/usr/bin/env bash
# Runs on the H200 machine (device tool), from the repository root:
#   bash benchmarks/gpu_run.sh [STEP ...]      steps: info tests codecs attention tiers engine disagg (disagg needs 2 GPUs)
# Installs the carried wheels (.whl: zstandard, lmdb, dflash), then runs each step, writing
# markdown to $OUT/<step>.md and logs to $OUT/<step>.log. Missing scripts are skipped.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(info tests codecs attention tiers engine)
for s in "${steps[@]}"; do
  start=$(date +%s)
  case "$s" in
    info) { nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
            python3 -c 'import torch,triton;print("torch",torch.__version__,"triton",triton.__version__,torch.cuda.get_device_name())'; } > "$OUT/info.log" 2>&1 ;;
    tests) TRITON_INTERPRET=0 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/codecs tests/tiers -k "cuda or gpu" > "$OUT/tests.log" 2>&1 ;;
    tiers) { python3 benchmarks/tiers_bench.py --device cuda --skip-disk --out "$OUT/tiers.md"
             python3 benchmarks/tiers_bench.py --device cuda --skip-disk --pages 1024 \
               --out "$OUT/tiers_stream.md"; } > "$OUT/tiers.log" 2>&1 ;;
    *) if [ -f "benchmarks/${s}_bench.py" ]; then
         python3 "benchmarks/${s}_bench.py" --device cuda --out "$OUT/$s.md" > "$OUT/$s.log" 2>&1
       else echo "no benchmarks/${s}_bench.py" > "$OUT/$s.log"; fi ;;
  esac
  echo "== $s: rc=$? $(( $(date +%s) - start ))s"; tail -5 "$OUT/$s.log"
done
