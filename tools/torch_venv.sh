#!/usr/bin/env bash
# Create or reuse a cached venv with one torch version and this checkout's graphzero (editable),
# then print its directory. Used by `make test-torch TORCH=x.y.z` (CI's second leg).
#
#   tools/torch_venv.sh 2.15.0
#
# The venv lives outside the clone, in ${GRAPHZERO_VENV_CACHE:-~/.cache/graphzero}, named after the
# torch version and a hash of pyproject.toml (new dependencies -> a new venv; old ones are left for
# the user to delete). It has
# - its own pip.conf with an empty `constraint =`: a machine-wide pip constraint (e.g. a cap on
#   torch) would otherwise refuse or replace the torch asked for;
# - its own torch_extensions/ (TORCH_EXTENSIONS_DIR): DeepSpeed's JIT-built ops are per torch.
# torch is installed first, by version only, so pip takes the build its index has (TORCH_INDEX_URL
# picks another index, e.g. https://download.pytorch.org/whl/cpu); graphzero's dependencies then
# keep it (pyproject's torch range admits every supported version).
set -euo pipefail
torch_version=${1:?usage: tools/torch_venv.sh TORCH_VERSION}
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
cache=${GRAPHZERO_VENV_CACHE:-$HOME/.cache/graphzero}
key=$(sha256sum "$root/pyproject.toml" | cut -c1-12)
venv=$cache/venv-torch-$torch_version-$key
log() { echo "torch_venv: $*" >&2; }

if [ ! -f "$venv/.installed" ]; then
  start=$(date +%s)
  log "creating $venv"
  rm -rf "$venv"
  mkdir -p "$cache"
  "$python" -m venv "$venv"
  printf '[global]\nconstraint =\n' > "$venv/pip.conf"
  "$venv/bin/python" -m pip install -q --upgrade pip >&2
  "$venv/bin/python" -m pip install -q ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$torch_version" >&2
  "$venv/bin/python" -m pip install -q -e "$root[test]" >&2
  got=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])')
  if [ "$got" != "$torch_version" ]; then
    log "installing graphzero replaced torch $torch_version with $got"
    exit 1
  fi
  echo "$root" > "$venv/.checkout"
  touch "$venv/.installed"
  log "created in $(( $(date +%s) - start )) s"
elif [ "$(cat "$venv/.checkout" 2>/dev/null)" != "$root" ]; then
  # the cached venv's editable install points at another clone: point it here (no dependency changes)
  log "reusing $venv for $root"
  "$venv/bin/python" -m pip install -q --no-deps -e "$root" >&2
  echo "$root" > "$venv/.checkout"
fi
mkdir -p "$venv/torch_extensions"
echo "$venv"
