# Sourced by the GPU scripts (device tool), from the repository root: $OUT for results, and the
# carried wheels (.whl: zstandard, lmdb, dflash, ...) installed into /tmp/site on PYTHONPATH.
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# The engine's CUDA tests (tests/runtime: graph replay == eager, overlapped == synchronous) build
# their tiny checkpoints with the DFlash reference and skip without it: carry its wheel too.
if ! ls .whl/dflash-*.whl >/dev/null 2>&1; then
  echo "note: no .whl/dflash-*.whl: tests/runtime's CUDA tests will skip (here, before the" \
       "device call: pip download --no-deps dflash==0.1.0 -d .whl)" >&2
fi
