#!/bin/bash
# DeadPool under Slurm: the job body every template runs (deadpool_h100.sbatch: 8 GPUs per node,
# deadpool_a100.sbatch: 4, deadpool_1gpu.sbatch: 1); also an sbatch script by itself, e.g. on the
# local cluster (experiments/slurm/local_cluster.sh), in CPU mode with 4 workers + 1 spare:
#
#   NUM_SPARES=1 DEVICE=cpu SRUN_ARGS= sbatch --ntasks=5 experiments/slurm/deadpool_job.sh model=tiny
#
# What runs where:
# - The coordinator (store, membership, recovery decisions) runs on the batch host (the
#   allocation's first node) as a child of this script, never as a training rank, so the store
#   outlives any rank. COORD_NODE=shared (the default): the batch host also runs a node agent and
#   trains. COORD_NODE=own: the batch host runs the coordinator only and the agents run on the
#   other nodes (allocate one node more): no rank's crash, OOM or GPU fault shares its node.
# - With node agents (the default, launcher.agents=true): one srun task per node runs
#   `python -m deadpool.agent` with all of the node's CPUs (an explicit count, below) and GPUs.
#   Each agent starts its node's ranks (RANKS_PER_NODE processes, one per GPU) as its children.
#   The ranks talk to their agent through shared memory in /dev/shm on the node; only the agents
#   talk to the store. An agent's death is the loss of its node: its ranks die with it.
# - Without agents (launcher.agents=false on the command line): one srun task per process runs
#   `python -m deadpool.rank.worker`, and every task talks to the store itself.
# Either way there are RANKS_PER_NODE processes on every node that trains (ranks and spares, one
# per GPU or CPU rank): the first NUM_WORKERS = processes - NUM_SPARES train, the others wait as
# warm spares (a whole node of them takes a lost node's ranks together).
#
# Environment (all optional): NUM_SPARES (0), TP, PP (1: dp = workers / (TP*PP)), DEVICE (cuda),
# RANKS_PER_NODE (the allocation's tasks per node), NUM_PROCS (RANKS_PER_NODE on each node that
# trains), COORD_NODE (shared | own), CPUS_PER_AGENT (the fewest CPUs the job has on a node,
# SLURM_JOB_CPUS_PER_NODE, divided among AGENTS_PER_HOST), RUN_DIR (outputs/slurm-<jobid>: the
# same across requeues), DEADPOOL_STORE_HOST (the batch host's NodeAddr in Slurm, else its name:
# set it to the address of the interface the other nodes reach it by when that differs),
# DEADPOOL_STORE_PORT (29500 + jobid % 1000), SRUN_ARGS (--cpu-bind=cores), PY (.venv/bin/python
# when present, else python), REQUEUE (0; 1: requeue the job after a walltime stop, below),
# AGENTS_PER_HOST (1; a test mode for a one-machine cluster: that many node agents per allocated
# machine, each standing for a node, CPU only since their children would share the machine's
# GPUs). Anything after the script name is passed to the coordinator as Hydra overrides
# (model=gpt_1b num_steps=1000 ...).
#
# Outputs land in RUN_DIR: job.json (the resolved config the tasks read), summary.json (outcome,
# every recovery with its timing breakdown), metrics.jsonl (per rank and step), final/rank<r>.pt
# (final state), checkpoints/ (periodic, fallback or stop checkpoints); the coordinator's log goes
# to the sbatch --output file, each srun task's stdout/stderr too (srun merges them there); with
# agents each rank's output goes to RUN_DIR/logs/slot<slot>.log.
#
# Walltime and preemption: a USR1 to this script (`#SBATCH --signal=B:USR1@300`: 5 minutes before
# the time limit; by hand `scancel -b -s USR1 <job>`) is forwarded to the coordinator, which has
# the newest step every rank holds in memory written to RUN_DIR/checkpoints and stops (exit
# 128 + 10); with REQUEUE=1 this script then requeues the job (`scontrol requeue`: the job must be
# requeueable, `#SBATCH --requeue`). SIGTERM (scancel, preemption, the time limit itself) reaches
# every process of the job from Slurm, the coordinator and the agents included: it is not
# forwarded (a second signal stops the coordinator at once, writing nothing), this script only
# keeps waiting for the coordinator's write (within Slurm's KillWait). A requeued run
# (SLURM_RESTART_COUNT > 0) keeps RUN_DIR and passes ft.resume_from=auto: it resumes from the
# newest complete checkpoint there. Otherwise, when the coordinator cannot recover in place (no
# spare left and ft.on_no_spare needs a relaunch, or checkpoint/restart), it writes the state to
# RUN_DIR/checkpoints, stops, and prints "relaunch the job with ft.resume_from=<dir>".
#SBATCH --job-name=deadpool
#SBATCH --output=deadpool-%j.out
set -euo pipefail
cd "${SLURM_SUBMIT_DIR:-.}"
die() { echo "deadpool_job.sh: $*" >&2; exit 2; }
if [ -z "${PY:-}" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
fi
NUM_SPARES=${NUM_SPARES:-0}
TP=${TP:-1}
PP=${PP:-1}
PER_HOST=${AGENTS_PER_HOST:-1}
COORD_NODE=${COORD_NODE:-shared}
BATCH_HOST=${SLURMD_NODENAME:-$(hostname -s)}
case "${COORD_NODE}" in
    shared) TRAIN_HOSTS=${SLURM_JOB_NUM_NODES}; EXCLUDE=() ;;
    own) (( SLURM_JOB_NUM_NODES >= 2 )) || die "COORD_NODE=own needs a node for the coordinator and at least one more"
         TRAIN_HOSTS=$(( SLURM_JOB_NUM_NODES - 1 )); EXCLUDE=(--exclude="${BATCH_HOST}") ;;
    *) die "COORD_NODE=${COORD_NODE}: shared or own" ;;
esac
RANKS_PER_NODE=${RANKS_PER_NODE:-$(( SLURM_NTASKS / SLURM_JOB_NUM_NODES ))}
NUM_PROCS=${NUM_PROCS:-$(( TRAIN_HOSTS * PER_HOST * RANKS_PER_NODE ))}
NUM_WORKERS=$(( NUM_PROCS - NUM_SPARES ))
if (( NUM_WORKERS <= 0 || NUM_WORKERS % (TP * PP) )); then
    die "$NUM_PROCS processes - $NUM_SPARES spares = $NUM_WORKERS workers, not a multiple of TP*PP=$((TP * PP))"
fi
DP=$(( NUM_WORKERS / (TP * PP) ))
DEVICE=${DEVICE:-cuda}
RUN_DIR=${RUN_DIR:-outputs/slurm-${SLURM_JOB_ID}}
SRUN_ARGS=${SRUN_ARGS---cpu-bind=cores}
REQUEUE=${REQUEUE:-0}

# CPUs: an explicit count for every step (srun does not take the job's --cpus-per-task the same
# way in every Slurm version): the fewest the job has on any of its nodes ('72(x2),36' -> 36)
if [ -z "${CPUS_PER_AGENT:-}" ]; then
    node_cpus=$(tr ',' '\n' <<< "${SLURM_JOB_CPUS_PER_NODE:-${SLURM_CPUS_ON_NODE:-1}}" | sed 's/(.*//' | sort -n | sed -n 1p)
    CPUS_PER_AGENT=$(( node_cpus / PER_HOST ))
fi
(( CPUS_PER_AGENT >= 1 )) || CPUS_PER_AGENT=1
CPUS_PER_RANK=$(( CPUS_PER_AGENT / RANKS_PER_NODE ))
(( CPUS_PER_RANK >= 1 )) || CPUS_PER_RANK=1

# the store listens on the batch host, at the address Slurm itself reaches that node by
if [ -z "${DEADPOOL_STORE_HOST:-}" ]; then
    DEADPOOL_STORE_HOST=$(scontrol show node "${BATCH_HOST}" 2>/dev/null | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2 || true)
    DEADPOOL_STORE_HOST=${DEADPOOL_STORE_HOST:-$(hostname)}
fi
export DEADPOOL_STORE_HOST
export DEADPOOL_STORE_PORT=${DEADPOOL_STORE_PORT:-$(( 29500 + SLURM_JOB_ID % 1000 ))}

# a requeued run resumes from the newest complete checkpoint in its run dir (unless told otherwise)
RESUME=()
if (( ${SLURM_RESTART_COUNT:-0} > 0 )); then
    RESUME=(ft.resume_from=auto)
    for a in "$@"; do
        case "$a" in ft.resume_from=*|+ft.resume_from=*|++ft.resume_from=*) RESUME=() ;; esac
    done
fi
echo "[deadpool_job] job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}): coordinator on ${BATCH_HOST}" \
     "(COORD_NODE=${COORD_NODE}, store ${DEADPOOL_STORE_HOST}:${DEADPOOL_STORE_PORT}); ${NUM_PROCS} processes" \
     "on ${TRAIN_HOSTS} node(s), dp=${DP} tp=${TP} pp=${PP} + ${NUM_SPARES} spares; ${CPUS_PER_AGENT} CPUs per agent;" \
     "RUN_DIR=${RUN_DIR} ${RESUME[*]-}"

# A fresh secret for this job, readable by this user only, in the run dir (a shared file system):
# the coordinator and every task read it from DEADPOOL_JOB_SECRET_FILE; it keeps every other
# process on the cluster out of the coordinator's store (deadpool/store/auth.py). rm first: a truncated
# old file would keep its old permissions.
mkdir -p "${RUN_DIR}"
export DEADPOOL_JOB_SECRET_FILE="$(cd "${RUN_DIR}" && pwd)/job.secret"
unset DEADPOOL_JOB_SECRET
rm -f "${DEADPOOL_JOB_SECRET_FILE}" "${RUN_DIR}/job.json"
(umask 077; "$PY" -c 'from deadpool.store.auth import new_secret; print(new_secret())' > "${DEADPOOL_JOB_SECRET_FILE}")

# walltime / preemption: USR1 is forwarded, TERM only waited through (see the header)
STOP_SIGNAL=
COORD=
on_usr1() {
    STOP_SIGNAL=USR1
    echo "[deadpool_job] USR1: asking the coordinator to write the newest step in memory and stop"
    if [ -n "${COORD}" ]; then kill -USR1 "${COORD}" 2>/dev/null || true; fi
}
on_term() {
    STOP_SIGNAL=${STOP_SIGNAL:-$1}
    echo "[deadpool_job] $1: every process of the job has it from Slurm; waiting for the coordinator to write and stop"
}
trap on_usr1 USR1
trap 'on_term TERM' TERM
trap 'on_term INT' INT

# 1. the coordinator, in the background on the batch host
"$PY" -m deadpool.train launcher=slurm device="${DEVICE}" parallel.dp=${DP} parallel.tp=${TP} parallel.pp=${PP} \
    parallel.ranks_per_node=${RANKS_PER_NODE} ft.num_spares=${NUM_SPARES} hydra.run.dir="${RUN_DIR}" \
    ${RESUME[@]+"${RESUME[@]}"} "$@" &
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
#    the rest some seconds after the first task ended (WaitTime). --no-kill: a node that fails
#    does not end the step on the other nodes (sbatch --no-kill keeps the allocation, but the
#    steps running on a failed node are killed unless srun asks for this too). A dead process is
#    not restarted: a warm spare takes its place, and the coordinator fences the dead rank out.
STEP_ARGS=(--no-kill --kill-on-bad-exit=0 --wait=0 ${EXCLUDE[@]+"${EXCLUDE[@]}"})
if [ -n "${SLURM_GPUS_PER_NODE:-}" ]; then STEP_ARGS+=(--gpus-per-node="${SLURM_GPUS_PER_NODE}"); fi
if [ "${AGENTS}" = 1 ]; then
    # one agent per node, holding all of the node's CPUs and GPUs for its children
    HOSTS=$(( (NODES + PER_HOST - 1) / PER_HOST ))
    if (( HOSTS > TRAIN_HOSTS )); then
        echo "deadpool_job.sh: $NUM_PROCS processes at RANKS_PER_NODE=$RANKS_PER_NODE need $NODES nodes, the job has $TRAIN_HOSTS for them (COORD_NODE=$COORD_NODE)" >&2
        kill ${COORD}; wait ${COORD} || true; exit 2
    fi
    srun "${STEP_ARGS[@]}" --nodes="${HOSTS}" --ntasks="${NODES}" --ntasks-per-node="${PER_HOST}" \
        --cpus-per-task="${CPUS_PER_AGENT}" ${SRUN_ARGS} \
        "$PY" -m deadpool.agent --job "${RUN_DIR}/job.json" --node-from-env &
else
    # one process per task; the coordinator decides who trains and who waits as a spare
    srun "${STEP_ARGS[@]}" --nodes="${TRAIN_HOSTS}" --ntasks="${NUM_PROCS}" --cpus-per-task="${CPUS_PER_RANK}" \
        ${SRUN_ARGS} "$PY" -m deadpool.rank.worker --job "${RUN_DIR}/job.json" --slot-from-env &
fi
SRUN=$!

set +e
# a trapped signal cuts `wait` short (status 128 + its number): wait again while the coordinator
# runs (a zombie answers kill -0 too); if it ended just then, the last wait gives its own status
while :; do
    wait ${COORD}; rc=$?
    kill -0 ${COORD} 2>/dev/null || break
done
if (( rc > 128 )); then
    wait ${COORD} 2>/dev/null; r=$?; (( r == 127 )) || rc=$r
fi
# every process leaves when the coordinator says the job is over; give them a moment, then end the step
for _ in $(seq 10); do kill -0 ${SRUN} 2>/dev/null || break; sleep 1; done
kill ${SRUN} 2>/dev/null
wait ${SRUN} 2>/dev/null
echo "[deadpool_job] coordinator exit ${rc}; outputs in ${RUN_DIR}"
if [ "${REQUEUE}" = 1 ] && [ "${STOP_SIGNAL}" = USR1 ] && (( rc == 128 + 10 )); then
    echo "[deadpool_job] stopped for the time limit with its state on disk: requeueing job ${SLURM_JOB_ID} (it resumes with ft.resume_from=auto)"
    scontrol requeue "${SLURM_JOB_ID}"
fi
exit ${rc}
