#!/usr/bin/env bash
# Issue 17 on the H200 (device tool), from the repository root. The whole job (training with the
# shipped recipe's caps, ~10 min, then the evaluation) outlasts one 10-minute call, so it runs as
# a detached process on the machine and two back-to-back calls watch it:
#   bash benchmarks/gpu_pair.sh start 560    # starts the job, follows it for 560 s
#   bash benchmarks/gpu_pair.sh wait 560     # the next call, within 30 s: follows it to the end
# Job: 1. scripts/train_tiny_pair.sh with its default caps (the shipped recipe) -> /tmp/pair (pair.tar as soon as each
# stage ends); 2. prompt-length sweep of the new pair through the paged engine (bf16): cold / warm
# per tier; 3. `kvstrata demo --device cuda` (default run) with the new pair.
# Results in $OUT: pair.tar, target.tar, train.log, new.json, sweeps.md, demo.json, demo.log, job.log.
set -uo pipefail
MODE="${1:-start}"; FOLLOW="${2:-560}"
JOB=/tmp/pairjob; PAIR=/tmp/pair
if [[ "$MODE" == start ]]; then
  rm -rf "$JOB" "$PAIR"; mkdir -p "$JOB"
  cat > "$JOB/job.sh" <<'JOBEOF'
source benchmarks/_device_env.sh
OUT=/tmp/pairjob; PAIR=/tmp/pair; LENS=256,1024,2048,3584
export PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
T0=$(date +%s); step() { echo "== $1 at $(( $(date +%s) - T0 ))s"; }
python3 -c 'import sys,torch,transformers;print(sys.version.split()[0],torch.__version__,transformers.__version__,torch.cuda.get_device_name())'
step train-target
PYTHON=python3 bash scripts/train_tiny_pair.sh "$PAIR" --device cuda --stage target \
  > "$OUT/train.log" 2>&1; echo "target rc=$?"
(cd "$PAIR" && tar cf "$OUT/target.tar" target)
step train-drafter
PYTHON=python3 bash scripts/train_tiny_pair.sh "$PAIR" --device cuda --stage drafter \
  >> "$OUT/train.log" 2>&1; echo "drafter rc=$?"
grep -E "done|AL by|total|wall" "$OUT/train.log"
(cd "$PAIR" && tar cf "$OUT/pair.tar" summary.json target drafter)
step sweep-new
python3 -m kvstrata.cli.main bench acceptance --device cuda --dtype bfloat16 --model "$PAIR" \
  --prompts 16 --max-tokens 128 --prompt-lens $LENS --scenarios paged,arena,tiers-mixed \
  --out "$OUT/new.json" > "$OUT/sweeps.md" 2>&1; echo "sweep rc=$?"; tail -c 2500 "$OUT/sweeps.md"
step demo
python3 -m kvstrata.cli.main demo --device cuda --model "$PAIR" --plot /tmp/demo.png \
  --json "$OUT/demo.json" > "$OUT/demo.log" 2>&1; echo "demo rc=$?"; tail -n 4 "$OUT/demo.log"
step end
touch "$OUT/DONE"
JOBEOF
  setsid bash "$JOB/job.sh" > "$JOB/job.log" 2>&1 < /dev/null &
fi
[[ -d "$JOB" ]] || { echo "no job on this machine (a fresh start): run 'start' again"; exit 3; }
END=$(( $(date +%s) + FOLLOW ))
while [[ ! -e "$JOB/DONE" && $(date +%s) -lt $END ]]; do sleep 5; done
cat "$JOB/job.log"
cp "$JOB"/*.{tar,log,json,md} "${OUT:-/tmp/out}/" 2>/dev/null
[[ -e "$JOB/DONE" ]] && echo "JOB DONE" || echo "JOB RUNNING (call 'wait' within 30 s)"
