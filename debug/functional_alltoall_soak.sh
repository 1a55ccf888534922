#!/bin/bash
# two ranks of debug/functional_alltoall_soak.py on this machine (arguments: iterations,
# --backward-only, --one-thread); logs in $OUT (default /tmp/graphzero-fa)
cd "$(dirname "$0")/.." && out=${OUT:-/tmp/graphzero-fa} && mkdir -p "$out"
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=${PORT:-29700} WORLD_SIZE=2 RANK=$r \
    .venv/bin/python -X faulthandler debug/functional_alltoall_soak.py "$@" > "$out/rank$r.log" 2>&1 &
done
wait
