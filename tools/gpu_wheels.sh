#!/usr/bin/env bash
# Wheels for a GPU machine that has its own CUDA torch but reaches no package index (the lent H200
# of docs/benchmarks-history.md "GPU check"): graphzero, DeepSpeed and what DeepSpeed needs beyond such an
# image (pydantic and friends, hjson) plus tabulate, for its Python (default 3.12), into .whl/.
#
#   tools/gpu_wheels.sh [PYTHON_VERSION]      # here, from the repository root, with `make install` done
#
# There, from the repository root with .whl/ carried (a few MiB; a CUDA torch wheel is GBs, so the
# machine's own torch is used, and one outside graphzero's range needs GRAPHZERO_ALLOW_UNTESTED_VERSIONS=1):
#
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1   # the installed wheel, not the checkout's graphzero/
#   PY=python3 bash tools/gpu_bench.sh
#
# PYTHONSAFEPATH keeps the working directory off sys.path: from the repository root, `import
# graphzero` would otherwise find the checkout, whose passes/ sits outside graphzero/.
set -euo pipefail
cd "$(dirname "$0")/.."
py_version=${1:-3.12}
PY=${PY:-.venv/bin/python}
out=.whl
rm -rf "$out" build
mkdir -p "$out"
# DeepSpeed ships an sdist only; built here against this venv's torch without its C++ ops (they
# JIT-build where used; graphzero's runs use torch's Adam). Its accelerator is detected at run time.
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$out" . "deepspeed==$("$PY" -c "from importlib.metadata import version; print(version('deepspeed'))")"
rm -rf build
deps=()
for name in pydantic pydantic-core annotated-types typing-inspection hjson tabulate; do
  deps+=("$name==$("$PY" -c "from importlib.metadata import version; print(version('$name'))")")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$py_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$out" "${deps[@]}"
if ! grep -qx '/.whl/' .git/info/exclude 2>/dev/null; then
  echo "note: add /.whl/ to .git/info/exclude so that the wheels stay out of commits" >&2
fi
ls -l "$out"
du -sh "$out"
