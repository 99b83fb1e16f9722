#!/usr/bin/env bash
# Set up and run the main job: `kvstrata demo` (extra arguments go to the demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/kvstrata demo "$@"
