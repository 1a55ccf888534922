#!/bin/bash
# two ranks of debug/functional_alltoall_soak.py on this machine (arguments: iterations, --backward-only);
# logs in /tmp/graphzero-fa
cd "$(dirname "$0")/.." && mkdir -p /tmp/graphzero-fa
for r in 0 1; do
  MASTER_ADDR=127.0.0.1 MASTER_PORT=${PORT:-29700} WORLD_SIZE=2 RANK=$r \
    .venv/bin/python -X faulthandler debug/functional_alltoall_soak.py "$@" > /tmp/graphzero-fa/rank$r.log 2>&1 &
done
wait
