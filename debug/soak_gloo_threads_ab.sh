#!/bin/bash
# one round: baseline and one-thread gloo soaks side by side, 5000 steps each, ZeRO-3
cd "$(dirname "$0")/.." && mkdir -p /tmp/graphzero-ab
round=$1
run() {  # name port entry...
  name=$1; port=$2; shift 2
  for r in 0 1; do
    MASTER_ADDR=127.0.0.1 MASTER_PORT=$port WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r \
      .venv/bin/python -X faulthandler "$@" --steps 5000 --stage 3 --sample-every 500 --warmup 500 \
      > /tmp/graphzero-ab/${name}_r${round}_rank$r.log 2>&1 &
  done
}
run base $((29800 + round)) -m graphzero_tools.soak
run one $((29900 + round)) -m graphzero_tools.soak --one-gloo-thread
wait
