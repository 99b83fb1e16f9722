#!/usr/bin/env bash
# Set up and run the test suite on the CPU (Triton kernels through the interpreter).
# KVSTRATA_HYPOTHESIS_PROFILE=nightly runs the long property runs; KVSTRATA_SLOW=1 the slow tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TRITON_INTERPRET=1
export KVSTRATA_HYPOTHESIS_PROFILE="${KVSTRATA_HYPOTHESIS_PROFILE:-ci}"
exec .venv/bin/python -m pytest -q "$@"
