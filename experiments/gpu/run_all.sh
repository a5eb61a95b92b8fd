#!/usr/bin/env bash
# The standing GPU checks (GPU-CHECKS.md), each bounded in time, results as JSON in OUT_DIR.
#
#   experiments/gpu/run_all.sh OUT_DIR [full|quick]
#
# full  (default, ~8-10 min on one H100): check 3 (20 NCCL generation cycles and one with a missing
#       peer), check 1 (gpt_1b, 1.41 B params, batch 4, 8 and 12 x 1024 tokens, loss read every
#       step; then batch 8 x 1 or 4 micro-batches, loss read deferred or every step), check 2
#       (hot-swap on CUDA, deterministic), then variants: idle-group aborts and missing peers on a
#       non-blocking communicator, and the hot-swap with deterministic algorithms off.
# quick (~3 min): the GPU-marked tests, then each check at a small size, to verify the set-up.
#
# Needs python3 with torch (CUDA), hydra-core, omegaconf and pyyaml importable, run from anywhere.
# Writes OUT_DIR/env.json, OUT_DIR/check_*.json and OUT_DIR/run_all.log (at most 8 files).
set -u
OUT_DIR=${1:?usage: run_all.sh OUT_DIR [full|quick]}
MODE=${2:-full}
LOG="run_all.log"
source "$(dirname "$0")/session.sh"

echo "=== start $(date -u +%FT%TZ) mode=$MODE"
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true
step env 60 "$PY" "$HERE/common.py" "$OUT_DIR/env.json"

if [ "$MODE" = quick ]; then
    step pytest-gpu 150 "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/deadpool tests/integration
    step nccl-cycle 60 "$PY" "$HERE/check_nccl_cycle.py" "$OUT_DIR" --cycles 3 --missing-peer-cycles 1 \
        --wait-bound-s 8
    step snapshot 120 "$PY" "$HERE/check_snapshot.py" "$OUT_DIR" --model small --batch-sizes 8 \
        --seq-len 256 --rounds 2 --bw-bytes $((1 << 28))
    step hotswap 120 "$PY" "$HERE/check_hotswap.py" "$OUT_DIR" --model tiny --steps 16 --timeout-s 110
else
    step nccl-cycle 80 "$PY" "$HERE/check_nccl_cycle.py" "$OUT_DIR" --cycles 20 --missing-peer-cycles 1 \
        --wait-bound-s 8
    step snapshot 240 "$PY" "$HERE/check_snapshot.py" "$OUT_DIR" --model gpt_1b --batch-sizes 8,12,4 \
        --seq-len 1024 --rounds 6
    step hotswap 120 "$PY" "$HERE/check_hotswap.py" "$OUT_DIR" --model small --steps 30 --timeout-s 110
    # the same model with the loss read only after the run, and 4 micro-batches per step
    step snapshot-overlap 240 "$PY" "$HERE/check_snapshot.py" "$OUT_DIR" --model gpt_1b --seq-len 1024 \
        --configs 8:1:deferred,8:4:deferred,8:4:item --rounds 4 --name check_snapshot_overlap
    # variants: abort of an idle group (teardown cost); a missing peer on a non-blocking communicator
    step nccl-cycle-variants 60 "$PY" "$HERE/check_nccl_cycle.py" "$OUT_DIR" --cycles 5 --pending none \
        --missing-peer-cycles 2 --missing-peer-nonblocking --wait-bound-s 8 --name check_nccl_cycle_variants
    step hotswap-control 90 "$PY" "$HERE/check_hotswap.py" "$OUT_DIR" --model small --steps 30 \
        --no-deterministic --name check_hotswap_nondeterministic --timeout-s 80
fi
echo "=== end $(date -u +%FT%TZ)"
