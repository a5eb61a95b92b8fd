#!/bin/bash
# DeadPool under Slurm: the job body both templates run (deadpool_a100.sbatch: 4 GPUs per node,
# deadpool_1gpu.sbatch: 1 GPU per node); also an sbatch script by itself, e.g. on the local
# cluster (experiments/slurm/local_cluster.sh), in CPU mode with 4 workers + 1 spare:
#
#   NUM_SPARES=1 DEVICE=cpu SRUN_ARGS= sbatch --ntasks=5 experiments/slurm/deadpool_job.sh model=tiny
#
# One srun task per GPU (or CPU rank). The first NUM_WORKERS = ntasks - NUM_SPARES tasks
# (SLURM_PROCID < NUM_WORKERS) train, the others wait as warm spares; the coordinator (store,
# membership, recovery decisions) runs on the batch host as its own process, never as a training
# rank, so the store outlives any task.
#
# Environment (all optional): NUM_SPARES (0), TP, PP (1: dp = workers / (TP*PP)), DEVICE (cuda),
# RANKS_PER_NODE (tasks per node), RUN_DIR (outputs/slurm-<jobid>), DEADPOOL_STORE_HOST (this
# host's name: set it to the cluster-internal interface address if that name resolves elsewhere),
# DEADPOOL_STORE_PORT (29500 + jobid % 1000), SRUN_ARGS (--cpu-bind=cores), PY (.venv/bin/python
# when present, else python). Anything after the script name is passed to the coordinator as
# Hydra overrides (model=gpt_1b num_steps=1000 ...).
#
# Outputs land in RUN_DIR: job.json (the resolved config the tasks read), summary.json (outcome,
# every recovery with its timing breakdown), metrics.jsonl (per rank and step), final/rank<r>.pt
# (final state), checkpoints/ (periodic or fallback checkpoints); the coordinator's log goes to
# the sbatch --output file, each task's stdout/stderr too (srun merges them there).
#
# Resume: when the coordinator cannot recover in place (no spare left and ft.on_no_spare needs a
# relaunch, or checkpoint/restart), it writes the state to RUN_DIR/checkpoints, stops, and prints
# "relaunch the job with ft.resume_from=<dir>"; submit again with that override (and a new RUN_DIR).
#SBATCH --job-name=deadpool
#SBATCH --output=deadpool-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
NUM_SPARES=${NUM_SPARES:-0}
TP=${TP:-1}
PP=${PP:-1}
NUM_WORKERS=$(( SLURM_NTASKS - NUM_SPARES ))
if (( NUM_WORKERS <= 0 || NUM_WORKERS % (TP * PP) )); then
    echo "deadpool_job.sh: $SLURM_NTASKS tasks - $NUM_SPARES spares = $NUM_WORKERS workers, not a multiple of TP*PP=$((TP * PP))" >&2
    exit 2
fi
DP=$(( NUM_WORKERS / (TP * PP) ))
RANKS_PER_NODE=${RANKS_PER_NODE:-$(( SLURM_NTASKS / SLURM_JOB_NUM_NODES ))}
DEVICE=${DEVICE:-cuda}
RUN_DIR=${RUN_DIR:-outputs/slurm-${SLURM_JOB_ID}}
SRUN_ARGS=${SRUN_ARGS---cpu-bind=cores}
export DEADPOOL_STORE_HOST=${DEADPOOL_STORE_HOST:-$(hostname)}
export DEADPOOL_STORE_PORT=${DEADPOOL_STORE_PORT:-$(( 29500 + SLURM_JOB_ID % 1000 ))}

# A fresh secret for this job, readable by this user only, in the run dir (a shared file system):
# the coordinator and every task read it from DEADPOOL_JOB_SECRET_FILE; it keeps every other
# process on the cluster out of the coordinator's store (deadpool/auth.py). rm first: a truncated
# old file would keep its old permissions.
mkdir -p "${RUN_DIR}"
export DEADPOOL_JOB_SECRET_FILE="$(cd "${RUN_DIR}" && pwd)/job.secret"
unset DEADPOOL_JOB_SECRET
rm -f "${DEADPOOL_JOB_SECRET_FILE}" "${RUN_DIR}/job.json"
(umask 077; "$PY" -c 'from deadpool.auth import new_secret; print(new_secret())' > "${DEADPOOL_JOB_SECRET_FILE}")

# 1. the coordinator, in the background on the batch host
"$PY" -m deadpool.train launcher=slurm device="${DEVICE}" parallel.dp=${DP} parallel.tp=${TP} parallel.pp=${PP} \
    parallel.ranks_per_node=${RANKS_PER_NODE} ft.num_spares=${NUM_SPARES} hydra.run.dir="${RUN_DIR}" "$@" &
COORD=$!
while [ ! -f "${RUN_DIR}/job.json" ]; do
    kill -0 ${COORD} 2>/dev/null || { wait ${COORD}; exit $?; }  # the coordinator refused the config
    sleep 0.5
done

# 2. one process per task; the coordinator decides who trains and who waits as a spare.
#    srun ends a whole step when a task dies unless told otherwise, which is what a hot swap must
#    survive: --kill-on-bad-exit=0 keeps the other tasks running after one is killed or exits
#    non-zero (overrides slurm.conf's KillOnBadExit), and --wait=0 stops srun from killing the rest
#    some seconds after the first task ended (WaitTime). A dead task is not restarted: a warm spare
#    takes its place, and the coordinator fences the dead rank out of the new communicators.
srun --kill-on-bad-exit=0 --wait=0 ${SRUN_ARGS} \
    "$PY" -m deadpool.worker --job "${RUN_DIR}/job.json" --slot-from-env &
SRUN=$!

set +e
wait ${COORD}
rc=$?
# every task leaves when the coordinator says the job is over; give them a moment, then end the step
for _ in $(seq 10); do kill -0 ${SRUN} 2>/dev/null || break; sleep 1; done
kill ${SRUN} 2>/dev/null
wait ${SRUN} 2>/dev/null
echo "[deadpool_job] coordinator exit ${rc}; outputs in ${RUN_DIR}"
exit ${rc}
