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
