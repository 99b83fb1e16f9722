#!/usr/bin/env bash
# Issue 17 in one H200 call (device tool), from the repository root:
#   bash benchmarks/gpu_pair.sh
# 1. trains the pair (scripts/train_tiny_pair.sh, shipped defaults) into /tmp/pair and packs it as
#    $OUT/pair.tar (config + weights + training.json of both models, summary.json);
# 2. prompt-length sweep of the new pair through the paged engine (bf16): cold / warm per tier;
# 3. `kvstrata demo --device cuda` (default run) with the new pair;
# 4. the same sweep (paged and arena only) of the shipped (old) pair;
# 5. `kvstrata demo --device cuda --long` with the new pair.
# Results go to $OUT (8 files: pair.tar, train.log, new.json, old.json, sweeps.md, demo.json,
# demo_long.json, demo.log).
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
PAIR=/tmp/pair
LENS=256,1024,2048,3584
step() { echo "== $1 at $(( $(date +%s) - T0 ))s"; }
T0=$(date +%s)
python3 -c 'import sys,torch,transformers;print(sys.version.split()[0],torch.__version__,transformers.__version__,torch.cuda.get_device_name())'
step train
PYTHON=python3 bash scripts/train_tiny_pair.sh "$PAIR" --device cuda > "$OUT/train.log" 2>&1
echo "train rc=$?"; grep -E "done|AL by|total" "$OUT/train.log"
(cd "$PAIR" && tar cf "$OUT/pair.tar" summary.json target drafter)
step sweep-new
python3 -m kvstrata.cli.main bench acceptance --device cuda --dtype bfloat16 --model "$PAIR" \
  --prompts 16 --max-tokens 128 --prompt-lens $LENS --scenarios paged,arena,tiers-mixed \
  --out "$OUT/new.json" > "$OUT/sweeps.md" 2>&1; echo "rc=$?"; tail -c 2500 "$OUT/sweeps.md"
step demo
python3 -m kvstrata.cli.main demo --device cuda --model "$PAIR" --plot /tmp/demo.png \
  --json "$OUT/demo.json" > "$OUT/demo.log" 2>&1; echo "demo rc=$?"; tail -n 4 "$OUT/demo.log"
step sweep-old
python3 -m kvstrata.cli.main bench acceptance --device cuda --dtype bfloat16 \
  --model kvstrata-tiny-py --prompts 16 --max-tokens 128 --prompt-lens $LENS \
  --scenarios paged,arena --out "$OUT/old.json" >> "$OUT/sweeps.md" 2>&1; echo "rc=$?"
tail -c 1500 "$OUT/sweeps.md"
step demo-long
python3 -m kvstrata.cli.main demo --device cuda --long --model "$PAIR" --plot /tmp/demo2.png \
  --json "$OUT/demo_long.json" >> "$OUT/demo.log" 2>&1; echo "demo --long rc=$?"
tail -n 4 "$OUT/demo.log"
step end
