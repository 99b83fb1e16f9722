#!/usr/bin/env bash
# Train the kvstrata-tiny-py pair: Qwen3 target, then its DFlash drafter (fixed seeds).
#   scripts/train_tiny_pair.sh OUT_DIR [--device cuda] [--stage target|drafter|all] [more flags]
# Writes OUT_DIR/target/ and OUT_DIR/drafter/ (config.json + model.safetensors each) and
# OUT_DIR/summary.json; prints held-out loss, bits/byte, greedy AL and timings.
# Smoke test on a CPU: scripts/train_tiny_pair.sh /tmp/tiny --device cpu --smoke
# Flags: python -m kvstrata.training --help.  Docs: docs/training.md.
set -euo pipefail
if [[ $# -lt 1 || "$1" == -* ]]; then
    echo "usage: $0 OUT_DIR [--device cuda|cpu] [--stage target|drafter|all] [flags]" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
export PYTHONHASHSEED=0
start=$(date +%s)
"$PYTHON" -m kvstrata.training "$@"
echo "[train_tiny_pair] wall time $(( $(date +%s) - start ))s"
