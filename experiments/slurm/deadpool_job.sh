#!/bin/bash
# DeadPool under Slurm: the job body both templates run (deadpool_a100.sbatch: 4 GPUs per node,
# deadpool_1gpu.sbatch: 1 GPU per node); also an sbatch script by itself, e.g. on the local
# cluster (experiments/slurm/local_cluster.sh), in CPU mode with 4 workers + 1 spare:
#
#   NUM_SPARES=1 DEVICE=cpu SRUN_ARGS= sbatch --ntasks=5 experiments/slurm/deadpool_job.sh model=tiny
#
# What runs where:
# - The coordinator (store, membership, recovery decisions) runs on the batch host as its own
#   process, never as a training rank, so the store outlives any rank.
# - With node agents (the default, launcher.agents=true): one srun task per node runs
#   `python -m deadpool.agent`. Each agent starts its node's ranks (RANKS_PER_NODE processes, one
#   per GPU) as its children. The ranks talk to their agent through shared memory in /dev/shm on
#   the node; only the agents talk to the store. An agent's death is the loss of its node: its
#   ranks die with it.
# - Without agents (launcher.agents=false on the command line): one srun task per GPU runs
#   `python -m deadpool.worker`, and every task talks to the store itself.
# Either way there are SLURM_NTASKS processes (ranks and spares, one per GPU or CPU rank): the
# first NUM_WORKERS = ntasks - NUM_SPARES train, the others wait as warm spares.
#
# Environment (all optional): NUM_SPARES (0), TP, PP (1: dp = workers / (TP*PP)), DEVICE (cuda),
# RANKS_PER_NODE (tasks per node), RUN_DIR (outputs/slurm-<jobid>), DEADPOOL_STORE_HOST (this
# host's name: set it to the cluster-internal interface address if that name resolves elsewhere),
# DEADPOOL_STORE_PORT (29500 + jobid % 1000), SRUN_ARGS (--cpu-bind=cores), PY (.venv/bin/python
# when present, else python), AGENTS_PER_HOST (1; a test mode for a one-machine cluster: that
# many node agents per allocated machine, each standing for a node, CPU only since their children
# would share the machine's GPUs). Anything after the script name is passed to the coordinator as
# Hydra overrides (model=gpt_1b num_steps=1000 ...).
#
# Outputs land in RUN_DIR: job.json (the resolved config the tasks read), summary.json (outcome,
# every recovery with its timing breakdown), metrics.jsonl (per rank and step), final/rank<r>.pt
# (final state), checkpoints/ (periodic or fallback checkpoints); the coordinator's log goes to
# the sbatch --output file, each srun task's stdout/stderr too (srun merges them there); with
# agents each rank's output goes to RUN_DIR/logs/slot<slot>.log.
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
# job.json is written by the coordinator: wait until it is complete, and read from it whether the
# job runs node agents and how many nodes it has
until [ -f "${RUN_DIR}/job.json" ] && DESCRIBE=$("$PY" -m deadpool.agent --job "${RUN_DIR}/job.json" --describe 2>/dev/null); do
    kill -0 ${COORD} 2>/dev/null || { wait ${COORD}; exit $?; }  # the coordinator refused the config
    sleep 0.5
done
read -r AGENTS NODES <<< "${DESCRIBE}"

# 2. the processes. srun ends a whole step when a task dies unless told otherwise, which is what a
#    hot swap must survive: --kill-on-bad-exit=0 keeps the other tasks running after one is killed
#    or exits non-zero (overrides slurm.conf's KillOnBadExit), and --wait=0 stops srun from killing
#    the rest some seconds after the first task ended (WaitTime). A dead process is not restarted:
#    a warm spare takes its place, and the coordinator fences the dead rank out.
if [ "${AGENTS}" = 1 ]; then
    # one agent per node, holding all of the node's CPUs and GPUs for its children
    PER_HOST=${AGENTS_PER_HOST:-1}
    HOSTS=$(( (NODES + PER_HOST - 1) / PER_HOST ))
    if (( HOSTS > SLURM_JOB_NUM_NODES )); then
        echo "deadpool_job.sh: $SLURM_NTASKS processes at RANKS_PER_NODE=$RANKS_PER_NODE need $NODES nodes, the job has $SLURM_JOB_NUM_NODES" >&2
        kill ${COORD}; wait ${COORD} || true; exit 2
    fi
    STEP_ARGS=(--nodes="${HOSTS}" --ntasks="${NODES}" --ntasks-per-node="${PER_HOST}"
               --cpus-per-task=$(( ${SLURM_CPUS_PER_TASK:-1} * RANKS_PER_NODE )))
    if [ -n "${SLURM_GPUS_PER_NODE:-}" ]; then STEP_ARGS+=(--gpus-per-node="${SLURM_GPUS_PER_NODE}"); fi
    srun --kill-on-bad-exit=0 --wait=0 "${STEP_ARGS[@]}" ${SRUN_ARGS} \
        "$PY" -m deadpool.agent --job "${RUN_DIR}/job.json" --node-from-env &
else
    # one process per task; the coordinator decides who trains and who waits as a spare
    srun --kill-on-bad-exit=0 --wait=0 ${SRUN_ARGS} \
        "$PY" -m deadpool.worker --job "${RUN_DIR}/job.json" --slot-from-env &
fi
SRUN=$!

set +e
wait ${COORD}
rc=$?
# every process leaves when the coordinator says the job is over; give them a moment, then end the step
for _ in $(seq 10); do kill -0 ${SRUN} 2>/dev/null || break; sleep 1; done
kill ${SRUN} 2>/dev/null
wait ${SRUN} 2>/dev/null
echo "[deadpool_job] coordinator exit ${rc}; outputs in ${RUN_DIR}"
exit ${rc}
