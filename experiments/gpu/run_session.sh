#!/usr/bin/env bash
# One short GPU session in two bounded parts (GPU-CHECKS.md, checks 4, 6, 7), JSON in OUT_DIR.
#
#   experiments/gpu/run_session.sh OUT_DIR a|b|c [cpu]
#
# a  (at most ~6.4 min): check 4, throughput (check_throughput.py): DeadPool compile=true with
#    snapshots on, then off (130 s each, the compile included), then plain PyTorch bf16 +
#    torch.compile (100 s); 370 s for the three. check_throughput.json
# c  (at most ~4.9 min): check 4's eager arms: DeadPool snapshots off, on (95 s each), plain fp32
#    + autocast; 270 s. check_throughput_eager.json
# b  (at most ~4.7 min, ~3 expected): check 6, start-up of a gpt_1b rank and its spare
#    (check_startup.py, 100 s), then check 7, a node of two ranks lost at once on NCCL
#    (check_nccl_multirank.py S5, 130 s for the job and its failure-free re-run).
# cpu (third argument): the same steps at a tiny size on the CPU (S5 on gloo), a smoke run.
#
# Needs python3 with torch, hydra-core, omegaconf and pyyaml importable. Every step runs under
# `timeout`. Writes OUT_DIR/env.json, the checks' JSON and OUT_DIR/session_<part>.log (flat,
# at most 4 files per part).
set -u
OUT_DIR=${1:?usage: run_session.sh OUT_DIR a|b [cpu]}
PART=${2:?usage: run_session.sh OUT_DIR a|b|c [cpu]}
DEV=${3:-cuda}
LOG="session_$PART.log"
source "$(dirname "$0")/session.sh"

echo "=== start $(date -u +%FT%TZ) part=$PART device=$DEV"
[ "$DEV" = cuda ] && { nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv || true; }
step env 30 "$PY" "$HERE/common.py" "$OUT_DIR/env.json"

if [ "$DEV" = cpu ]; then
    TP=(--device cpu --model tiny --batch-size 2 --seq-len 32 --steps 12 --warmup 2 --settled 4)
    ST=(--device cpu --model tiny --batch-size 2 --seq-len 32)
    MR=(--device cpu --steps 12)
else
    TP=() ST=() MR=()
fi
case "$PART" in
a)
    step throughput 385 "$PY" "$HERE/check_throughput.py" "$OUT_DIR" ${TP[@]+"${TP[@]}"} \
        --arms deadpool_on_compile,deadpool_off_compile,plain \
        --compile-timeout-s 130 --plain-timeout-s 100 --budget-s 370
    ;;
c)
    step throughput-eager 285 "$PY" "$HERE/check_throughput.py" "$OUT_DIR" ${TP[@]+"${TP[@]}"} \
        --arms deadpool_off,deadpool_on,plain_fp32_autocast --name check_throughput_eager \
        --timeout-s 95 --plain-timeout-s 100 --budget-s 270
    ;;
b)
    step startup 110 "$PY" "$HERE/check_startup.py" "$OUT_DIR" ${ST[@]+"${ST[@]}"} --timeout-s 100
    step node-loss 140 "$PY" "$HERE/check_nccl_multirank.py" "$OUT_DIR" --scenarios S5 \
        --name check_nccl_multirank_s5 --job-timeout-s 130 ${MR[@]+"${MR[@]}"}
    ;;
*)
    echo "unknown part $PART (a, b or c)"; exit 2 ;;
esac
echo "=== end $(date -u +%FT%TZ)"
