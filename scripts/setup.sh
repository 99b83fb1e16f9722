#!/usr/bin/env bash
# Create .venv (if missing) and install kvstrata with its test extras, pinned by constraints.txt.
# `pip install torch==2.13.0` takes the CPU build where one lies on disk; an unpinned torch would
# pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvstrata-installed
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[dev,ref,serve]"
  # The DFlash reference (a test oracle) pins datasets/requests it never imports for
  # `dflash.model`; install it alone so the test env stays light.
  .venv/bin/python -m pip install -q --no-deps -c constraints.txt dflash
  echo "$want" > "$stamp"
fi
