#!/usr/bin/env bash
# The wheels `python -m latency_bench shapes --shapes real` needs on a GPU machine whose
# image holds PyTorch (and transformers' own requirements: huggingface-hub, tokenizers,
# safetensors, numpy, pyyaml, pillow, prometheus-client, psutil, jinja2, httpx) but not
# diffusers, this repo's transformers or pydantic: downloaded here, for CPython 3.12 on
# x86-64 Linux (override with PYVER=3.11 ...), into .whl/ (about 20 MB). Versions: the
# ones this checkout's venv runs (the ones the tests pass on).
#
#   scripts/shapes-wheels.sh            # -> .whl/*.whl
# then, on the GPU machine, from the repo root:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 -m latency_bench shapes --shapes real --device cuda --dtype bfloat16 --isolate --budget-s 360 --json shapes.json
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
PYVER=${PYVER:-3.12}
OUT=${OUT:-.whl}
pins=()
for pkg in transformers diffusers pydantic pydantic-core annotated-types typing-inspection importlib-metadata lazy-importer; do
  v=$("$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg" 2>/dev/null) || { echo "error: $pkg is not in $PY's environment (run make install)" >&2; exit 1; }
  pins+=("$pkg==$v")
done
mkdir -p "$OUT"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$OUT" "${pins[@]}"
ls -1 "$OUT"
du -sh "$OUT"
