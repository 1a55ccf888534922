#!/usr/bin/env bash
# The prepared GPU check (issue 9): one short command for a session that is lent an NVIDIA GPU.
#
#   bash tools/gpu_bench.sh            # on the GPU machine, from the repository root, after `make install`
#   GPU_BENCH_DRY_RUN=1 bash tools/gpu_bench.sh   # the same plumbing on CPU, tiny sizes (for a check here)
#   tools/gpu_wheels.sh                # here: wheels for a lent machine that has torch but no pip access
#
# World size 2 where 2 GPUs exist (real NCCL traffic: the ZeRO-2 vs DDP and ZeRO-3 vs DeepSpeed
# targets are about that), else 1 (two NCCL ranks cannot share a GPU; DeepCompile also needs one GPU
# per rank); GPU_BENCH_WORLD overrides. The mlp and transformer workloads, ZeRO-2 fp32 and bf16, every runner graphzero-compare has
# (graphzero inductor/eager, DeepSpeed eager with engine.backward and with plain backward,
# DeepCompile, FSDP2, DDP, and torch-compile-fused: plain torch.compile + AdamW(fused=True), the
# single-process ideal, which runs at world size 1 only). The table has each runner's forward /
# backward / optimizer-step split (CUDA events) and its ratio to the ideal ("x ideal").
# Results: JSON under $OUT (or gpu-bench/), and a section appended to docs/benchmarks-history.md with the
# command, the machine and the date. Bounded: every run has a timeout.
#
# A lease is short (minutes), so the timing stage can be narrowed and bounded:
#   GPU_BENCH_CASES="mlp:2:fp32 mlp:3:fp32"   model:stage:dtype list (default: mlp and transformer,
#                                              ZeRO-2, fp32 and bf16)
#   GPU_BENCH_RUNNERS=graphzero-inductor,ddp   graphzero-compare --runners (default: all)
#   GPU_BENCH_DEADLINE_S=300                   start no timing case after this many seconds
# Every file written under $OUTDIR: section.md, smoke-N.log, bench.log (all timing output) and one
# JSON per case (at most 8 files come back from a lent machine).
#
# Stage 1, before any timing: a correctness smoke (tools/gpu_smoke.py): a two-engine GAN at ZeRO-2
# and ZeRO-3 under graphzero against a single-process reference on the same device, gradients,
# norms and parameters over 3 steps; world size 1, and 2 NCCL ranks where 2 GPUs exist (the dry
# run: 1 and 2 gloo ranks on CPU). Any FAIL stops the script (exit 1): no timing of wrong numbers.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUTDIR=${OUT:-gpu-bench}
mkdir -p "$OUTDIR"
if [ "${GPU_BENCH_DRY_RUN:-0}" = 1 ]; then
  device=cpu; size=(--tiny); steps=(--steps 2 --warmup 1); export DS_ACCELERATOR=cpu
else
  device=cuda; size=(); steps=(--steps 20 --warmup 3)
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: use GPU_BENCH_DRY_RUN=1')"
fi
machine=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'CPU')")
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
if [ "$device" = cuda ] && [ "$gpus" -ge 2 ]; then world_size=${GPU_BENCH_WORLD:-2}; else world_size=${GPU_BENCH_WORLD:-1}; fi
{
  echo
  echo "## GPU check (tools/gpu_bench.sh), $(date -u +%Y-%m-%d), $machine, timing at world size $world_size"
  echo
} >> "$OUTDIR/section.md"

# -- stage 1: correctness smoke -----------------------------------------------------------------
worlds=(1)
if [ "$device" = cpu ] || [ "$gpus" -ge 2 ]; then worlds=(1 2); fi
for world in "${worlds[@]}"; do
  cmd=("$PY" -m graphzero_tools.gpu_smoke --device "$device" --world-size "$world")
  echo "\$ ${cmd[*]}" | tee -a "$OUTDIR/section.md"
  set +e
  timeout 600 "${cmd[@]}" > "$OUTDIR/smoke-$world.log" 2>&1
  rc=$?
  set -e
  verdict=$(grep -E '^GPU SMOKE: ' "$OUTDIR/smoke-$world.log" | tail -n 1 || true)
  { echo '```'; grep -E '^\[rank [0-9]+\] FAIL' "$OUTDIR/smoke-$world.log" | head -n 10 || true
    echo "${verdict:-GPU SMOKE: FAIL (exit code $rc, no verdict; see $OUTDIR/smoke-$world.log)}"
    echo '```'; } | tee -a "$OUTDIR/section.md"
  if [ "$rc" -ne 0 ] || [ "${verdict#GPU SMOKE: PASS}" = "$verdict" ]; then
    tail -n 40 "$OUTDIR/smoke-$world.log" >&2
    echo "correctness smoke failed (world size $world, exit code $rc): no timing" >&2
    if [ "${GPU_BENCH_DRY_RUN:-0}" != 1 ]; then cat "$OUTDIR/section.md" >> docs/benchmarks-history.md; fi
    exit 1
  fi
done

# -- stage 2: timing ----------------------------------------------------------------------------
cases=(${GPU_BENCH_CASES:-mlp:2:fp32 mlp:2:bf16 transformer:2:fp32 transformer:2:bf16})
runners=()
if [ -n "${GPU_BENCH_RUNNERS:-}" ]; then runners=(--runners "$GPU_BENCH_RUNNERS"); fi
for case in "${cases[@]}"; do
  IFS=: read -r model stage dtype <<< "$case"
  if [ -n "${GPU_BENCH_DEADLINE_S:-}" ] && [ "$SECONDS" -ge "$GPU_BENCH_DEADLINE_S" ]; then
    echo "(skipped $case: ${SECONDS}s elapsed, deadline ${GPU_BENCH_DEADLINE_S}s)" | tee -a "$OUTDIR/section.md"
    continue
  fi
  json="$OUTDIR/$model-z$stage-$dtype.json"
  cmd=("$PY" -m graphzero_tools.compare --model "$model" --stage "$stage" --dtype "$dtype" --world-size "$world_size"
       --device "$device" "${size[@]}" "${steps[@]}" "${runners[@]}" --no-progress --timeout 120 --json "$json")
  echo "\$ ${cmd[*]}" | tee -a "$OUTDIR/section.md" "$OUTDIR/bench.log"
  set +e
  timeout 300 "${cmd[@]}" > "$OUTDIR/case.log" 2>&1
  rc=$?
  set -e
  cat "$OUTDIR/case.log" >> "$OUTDIR/bench.log"
  # the table and its failures; the column notes are the same in every run (in bench.log)
  { echo '```'; sed -n '/^graphzero-compare: /,/^tolerance for/p' "$OUTDIR/case.log" | sed '$d'
    if [ "$rc" -ne 0 ]; then echo "(exit code $rc; see bench.log)"; fi; echo '```'; } | tee -a "$OUTDIR/section.md"
done
rm -f "$OUTDIR/case.log"
if [ "${GPU_BENCH_DRY_RUN:-0}" != 1 ]; then
  cat "$OUTDIR/section.md" >> docs/benchmarks-history.md
fi
echo "wrote $OUTDIR/section.md"
