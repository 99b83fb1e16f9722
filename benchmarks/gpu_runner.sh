#!/usr/bin/env bash
# Runs on the H200 machine (device tool), from the repository root (issue 13, the model runner):
#   bash benchmarks/gpu_runner.sh [STEP ...]
#   steps: tests sweep attn b1 one pdl0 ab bench peer e2e profile kprof kprofb kprofref tiles
#   gated rope bsweep vsweep persistent dataflow segment cap switches
# tests: the runner's CUDA test set (TESTS="paths" for fewer); sweep: the batch-1 split sweep of
# the attention kernel; b1: batch-1 steps with several min_split_tokens; one: batch-1 steps;
# ab: steps at AB_BATCHES (1) of this tree and of a kvstrata package copied into _ref/ (carry
# it: e.g. `git archive REV kvstrata | tar -x -C _ref`), alternating processes (AB_ROUNDS;
# AB_VARIANTS: more processes of this tree, each with ENV=v[+ENV=v...]; AB_BASE (new ref): the
# processes before them; AB_ARGS: more
# runner_bench arguments); attn: batch-1 decode
# attention alone at 1k, 8k, 32k, split + merge against the fused merge; tiles: the q/k/v,
# o_proj and down products over a tile grid, and L2-hot; gated: gate/up with SiLU in the
# product against two launches; bench: runner_bench (batches 1 16 64; BENCH_ARGS); peer: the
# transformers peer (hf_decode_peer.py beside this repository's root, static cache + compile);
# e2e: the shipped pair end to end; pdl0: batch-1 steps with KVSTRATA_PDL=0; profile: per-kernel
# device time of the batch-1 graphs and the linear layers alone (runner_profile.py; kprof: the
# graphs only; kprofb: the speculative step's graphs, host parts and whole step at
# KPROF_BATCHES (16), KPROF_ARGS e.g. "--width 4"; kprofref: kprof of the _ref/ package);
# rope: the q/k norm + RoPE kernel's tiles alone; bsweep: verify attention at BSWEEP_BATCHES (16 64) with BSWEEP_Q (16)
# queries per sequence over split counts and tiles in the runner's grid (BSWEEP_ARGS: more
# runner_bench arguments, e.g. --sweep-contexts 8192); vsweep: batch-1 verify attention over q blocks, fused merge,
# split lengths and tiles; persistent: benchmarks/persistent_chain.py (a smoke run of 2 layers,
# then 36; PERSIST_ARGS, e.g. "--modes mma --rings 16x12"); dataflow:
# benchmarks/dataflow_chain.py (DATAFLOW_ARGS, e.g. "--sg 16"); segment:
# benchmarks/segment_proto.py (attention + o_proj in one launch; SEG_ARGS); cap: batch-1 decode
# attention at 32k-128k with the CUDA launch capped at 32k (Triton past it), then at 128k;
# switches: batch-1 decode attention's builds (decode_segment's pages / unroll / hwait / warps
# switches) at 1k-64k against the floor and Triton, one process (decode_switches_bench.py;
# SWITCH_ARGS, e.g. "--contexts 8192 65536 --rounds 5"). Markdown/logs go to
# $OUT/<step>.{md,log}; each step's last
# TAIL (6) log lines are printed.
set -uo pipefail
source "$(dirname "$0")/_device_env.sh"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(tests sweep bench peer)
for s in "${steps[@]}"; do
  start=$(date +%s)
  case "$s" in
    tests) timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
             ${TESTS:-tests/runtime/test_runner_cuda.py tests/kernels} > "$OUT/tests.log" 2>&1 ;;
    sweep) python3 benchmarks/runner_bench.py --sweep --sweep-contexts 8192 32768 --batches \
             --attn-contexts --out "$OUT/sweep.md" > "$OUT/sweep.log" 2>&1 ;;
    vsweep) python3 benchmarks/runner_bench.py --batches --attn-contexts --sweep-contexts 1024 \
              8192 --verify-sweep --out "$OUT/vsweep.md" > "$OUT/vsweep.log" 2>&1 ;;
    bsweep) python3 benchmarks/runner_bench.py --batches --attn-contexts --sweep-contexts 1024 \
              8192 --batch-sweep ${BSWEEP_BATCHES:-16 64} --batch-sweep-q ${BSWEEP_Q:-16} \
              ${BSWEEP_ARGS:-} --out "$OUT/bsweep.md" \
              > "$OUT/bsweep.log" 2>&1 ;;
    b1) python3 benchmarks/runner_bench.py --batches 1 --steps 16 --attn-contexts 8192 \
          --min-split ${MIN_SPLITS:-256 512 1024} --out "$OUT/b1.md" > "$OUT/b1.log" 2>&1 ;;
    pdl0) KVSTRATA_PDL=0 python3 benchmarks/runner_bench.py --batches 1 --steps 24 \
            --attn-contexts --out "$OUT/pdl0.md" > "$OUT/pdl0.log" 2>&1 ;;
    profile) python3 benchmarks/runner_profile.py --profile --gemm --gemm-tiles \
               --out "$OUT/profile.md" > "$OUT/profile.log" 2>&1 ;;
    kprof) python3 benchmarks/runner_profile.py --profile --out "$OUT/kprof.md" \
             > "$OUT/kprof.log" 2>&1 ;;
    rope) python3 benchmarks/runner_profile.py --rope --out "$OUT/rope.md" > "$OUT/rope.log" 2>&1 ;;
    kprofb) python3 benchmarks/runner_profile.py --profile --batches ${KPROF_BATCHES:-16} \
              ${KPROF_ARGS:-} --out "$OUT/kprofb.md" > "$OUT/kprofb.log" 2>&1 ;;
    kprofref) PYTHONPATH="/tmp/site:$PWD/_ref:$PWD" python3 benchmarks/runner_profile.py \
                --profile --out "$OUT/kprofref.md" > "$OUT/kprofref.log" 2>&1 ;;
    gated) python3 benchmarks/runner_profile.py --gated --out "$OUT/gated.md" \
             > "$OUT/gated.log" 2>&1 ;;
    tiles) python3 benchmarks/runner_profile.py --gemm --gemm-tiles --gemm-hot --gemm-shapes \
             qkv o_proj down --out "$OUT/tiles.md" > "$OUT/tiles.log" 2>&1 ;;
    one) python3 benchmarks/runner_bench.py --batches 1 --steps 24 --attn-contexts \
           --out "$OUT/one.md" > "$OUT/one.log" 2>&1 ;;
    ab) for r in ${AB_ROUNDS:-1 2}; do   # this tree against the kvstrata package in _ref/
           for t in ${AB_BASE-new ref} ${AB_VARIANTS:-}; do   # a variant: this tree with ENV=v[+ENV=v...]
             echo "== $t (round $r)"
             pp="$PYTHONPATH"; envs=()
             case $t in
               ref) pp="/tmp/site:$PWD/_ref:$PWD" ;;
               new) ;;
               *) IFS=+ read -ra envs <<< "$t" ;;
             esac
             env "${envs[@]}" PYTHONPATH=$pp python3 benchmarks/runner_bench.py --batches \
               ${AB_BATCHES:-1} --steps 24 --attn-contexts ${AB_ARGS:-} 2>&1 \
               | grep "^| [pvsd]\|^GPU while"
           done
         done > "$OUT/ab.log" 2>&1 ;;
    cap) for cap in 32768 131072; do    # batch-1 decode attention past 32k: Triton, then CUDA
           echo "== ATTENTION_MAX_CONTEXT $cap"
           python3 benchmarks/attention_bench.py --cases 1x32768,1x65536,1x131072 \
             --decode-segment-cap $cap 2>&1 | grep "^|"
         done > "$OUT/cap.log" 2>&1 ;;
    switches) timeout 540 python3 benchmarks/decode_switches_bench.py ${SWITCH_ARGS:-} \
                --out "$OUT/switches.md" > "$OUT/switches.log" 2>&1 ;;
    attn) python3 benchmarks/runner_bench.py --batches --attn-contexts 1024 8192 32768 \
            --out "$OUT/attn.md" > "$OUT/attn.log" 2>&1 ;;
    bench) python3 benchmarks/runner_bench.py --steps 16 --attn-contexts 8192 32768 \
             ${BENCH_ARGS:-} --out "$OUT/bench.md" > "$OUT/bench.log" 2>&1 ;;
    e2e) python3 benchmarks/runner_bench.py --batches --attn-contexts --e2e \
           --out "$OUT/e2e.md" > "$OUT/e2e.log" 2>&1 ;;
    peer) python3 "${PEER:-hf_decode_peer.py}" 1024 8192 > "$OUT/peer.log" 2>&1 ;;
    persistent) { timeout 90 python3 benchmarks/persistent_chain.py --layers 2 --reps 3 &&
                  timeout 300 python3 benchmarks/persistent_chain.py ${PERSIST_ARGS:-} \
                    --out "$OUT/persistent.md"; } > "$OUT/persistent.log" 2>&1 ;;
    dataflow) timeout 150 python3 benchmarks/dataflow_chain.py ${DATAFLOW_ARGS:-} \
                --out "$OUT/dataflow.md" > "$OUT/dataflow.log" 2>&1 ;;
    segment) timeout 420 python3 benchmarks/segment_proto.py ${SEG_ARGS:-} \
                --out "$OUT/segment.md" > "$OUT/segment.log" 2>&1 ;;
    *) echo "unknown step $s" > "$OUT/$s.log" ;;
  esac
  echo "== $s: rc=$? $(( $(date +%s) - start ))s"; tail -${TAIL:-6} "$OUT/$s.log"
done
