#!/usr/bin/env bash
# A real single-node Slurm cluster on this machine, to try the DeadPool templates on a laptop and
# to run the Slurm integration test (tests/integration/test_slurm.py):
#
#   experiments/slurm/local_cluster.sh start     # installs slurm-wlm + munge if missing (root), starts
#                                                # munged, slurmctld and slurmd on localhost
#   eval "$(experiments/slurm/local_cluster.sh env)"   # SLURM_CONF for sinfo / sbatch / srun
#   experiments/slurm/local_cluster.sh status
#   experiments/slurm/local_cluster.sh stop
#
# Everything (slurm.conf, state, spool, logs) lives in $DEADPOOL_SLURM_DIR (default
# /tmp/deadpool-slurm). The node declares $DEADPOOL_SLURM_CPUS CPUs (default 32) whatever the
# machine has (SlurmdParameters=config_overrides) and the partition oversubscribes them, so a
# 2-core laptop can run a 5-task job. No cgroups (proctrack/linuxproc, task/none), no accounting,
# no systemd: the daemons are started directly.
#
# DEADPOOL_SLURM_NODES=N (default 1) declares N nodes dp0 .. dp<N-1> instead, each its own slurmd
# on this machine (slurmd -N, ports $DEADPOOL_SLURMD_PORT + i), at this machine's first
# non-loopback address (a store on loopback is refused for a job of several nodes): a job then
# has a batch host and other nodes as on a cluster, and a node is lost by killing its slurmd
# (Slurm marks it down after $DEADPOOL_SLURMD_TIMEOUT_S, 10 s here).
set -euo pipefail
DIR=${DEADPOOL_SLURM_DIR:-/tmp/deadpool-slurm}
CPUS=${DEADPOOL_SLURM_CPUS:-32}
# memory the node offers jobs (MB): the machine's, so jobs asking for --mem (Hydra's submitit
# launcher does) are accepted
MEM=${DEADPOOL_SLURM_MEM_MB:-$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)}
CONF=$DIR/etc/slurm.conf
HOST=$(hostname -s)
NODES=${DEADPOOL_SLURM_NODES:-1}
SLURMD_PORT=${DEADPOOL_SLURMD_PORT:-6818}

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "Slurm is not installed: run as root, or install the Debian/Ubuntu packages slurm-wlm and munge" >&2
        exit 1
    fi
    echo "[local_cluster] installing slurm-wlm and munge ..."
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null; }
}

write_conf() {
    mkdir -p "$DIR/etc" "$DIR/state" "$DIR/spool" "$DIR/log"
    cat > "$CONF" <<CONF
# written by experiments/slurm/local_cluster.sh
ClusterName=deadpool-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=$(id -un)
SlurmdUser=root
AuthType=auth/munge
# a requeued job waits this long before it starts again (a job credential's lifetime; 120 s
# by default; long enough for a step launch on a loaded 2-core machine): the walltime test
# of test_slurm.py requeues one
AuthInfo=cred_expire=15
CredType=cred/munge
SlurmctldPort=${DEADPOOL_SLURMCTLD_PORT:-6817}
SlurmdPort=$SLURMD_PORT
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
# a task's death must not end the step (srun --kill-on-bad-exit=0 in the templates says it too)
KillOnBadExit=0
# 0: srun waits for every task, however long after the first one ended
WaitTime=0
InactiveLimit=0
MinJobAge=300
CONF
    if [ "$NODES" = 1 ]; then
        cat >> "$CONF" <<CONF
SlurmdSpoolDir=$DIR/spool
SlurmdPidFile=$DIR/slurmd.pid
SlurmdLogFile=$DIR/log/slurmd.log
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=local Nodes=$HOST Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
        return
    fi
    local addr
    addr=$(hostname -I 2>/dev/null | tr ' ' '\n' | grep -v '^127\.' | grep -v ':' | sed -n 1p)
    cat >> "$CONF" <<CONF
SlurmdSpoolDir=$DIR/spool/%n
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmdTimeout=${DEADPOOL_SLURMD_TIMEOUT_S:-10}
CONF
    for i in $(seq 0 $((NODES - 1))); do
        echo "NodeName=dp$i NodeHostname=$HOST NodeAddr=${addr:-127.0.0.1} Port=$((SLURMD_PORT + i)) CPUs=$CPUS RealMemory=$MEM State=UNKNOWN" >> "$CONF"
    done
    echo "PartitionName=local Nodes=dp[0-$((NODES - 1))] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4" >> "$CONF"
}

start_munge() {
    if pgrep -x munged >/dev/null; then return; fi
    if [ ! -s /etc/munge/munge.key ]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    if id munge >/dev/null 2>&1; then
        chown munge:munge /etc/munge/munge.key /run/munge /var/log/munge /var/lib/munge
        chmod 0400 /etc/munge/munge.key
        runuser -u munge -- /usr/sbin/munged
    else
        /usr/sbin/munged --force
    fi
}

status() {
    SLURM_CONF=$CONF sinfo -h -o "%N %t %c" 2>/dev/null
}

start() {
    install
    write_conf
    start_munge
    pgrep -f "slurmctld -f $CONF" >/dev/null || /usr/sbin/slurmctld -f "$CONF"
    if [ "$NODES" = 1 ]; then
        pgrep -f "slurmd -f $CONF" >/dev/null || /usr/sbin/slurmd -f "$CONF"
    else
        for i in $(seq 0 $((NODES - 1))); do
            mkdir -p "$DIR/spool/dp$i"
            pgrep -f "slurmd -f $CONF -N dp$i\$" >/dev/null || /usr/sbin/slurmd -f "$CONF" -N "dp$i"
        done
    fi
    for _ in $(seq 60); do
        # every node up (sinfo's lines group nodes by state)
        state=$(status | awk '{print $2}' | sort -u | tr '\n' ' ')
        case "$state" in
            "idle " | "mix " | "alloc ")
                echo "[local_cluster] up: $NODES node(s) on $HOST ($CPUS CPUs each, oversubscribed), partition local; SLURM_CONF=$CONF"
                return ;;
        esac
        sleep 1
    done
    echo "[local_cluster] the node did not come up (state '${state:-none}'); logs in $DIR/log" >&2
    tail -5 "$DIR/log/slurmctld.log" "$DIR"/log/slurmd*.log >&2 || true
    exit 1
}

stop() {
    pkill -f "slurmd -f $CONF" 2>/dev/null || true
    pkill -f "slurmctld -f $CONF" 2>/dev/null || true
    for _ in $(seq 20); do
        pgrep -f "slurm(ctl)?d -f $CONF" >/dev/null || break
        sleep 0.5
    done
    echo "[local_cluster] stopped (munged left running; state in $DIR)"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status || { echo "not running"; exit 1; } ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 start|stop|status|env" >&2; exit 2 ;;
esac
