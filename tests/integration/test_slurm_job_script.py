"""The Slurm job body (experiments/slurm/deadpool_job.sh) with stand-ins for srun, scontrol and
the Python processes on PATH: what it asks Slurm for and how it handles signals, without a
Slurm. test_slurm.py runs it on a real (single-node) Slurm.

The stand-in coordinator writes job.json, records its arguments and environment, and exits on
its own once told to (a file), or with 128 + 10 on SIGUSR1 (as ``python -m deadpool.train`` does
when a signal stopped it); srun and scontrol record their arguments."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB = ROOT / "experiments/slurm/deadpool_job.sh"
TEMPLATES = sorted((ROOT / "experiments/slurm").glob("*.sbatch"))

PY_STUB = r"""#!/bin/bash
# stand-in for the job's python: a secret, an agent's --describe, or the coordinator
log=$STUB_DIR/calls
if [ "$1" = -c ]; then echo secret; exit 0; fi
if [ "$2" = deadpool.agent ]; then echo "1 $STUB_NODES"; exit 0; fi
echo "coordinator $*" >> "$log"
echo "store $DEADPOOL_STORE_HOST:$DEADPOOL_STORE_PORT" >> "$log"
for a in "$@"; do case "$a" in hydra.run.dir=*) dir=${a#hydra.run.dir=} ;; esac; done
trap 'echo "coordinator got USR1" >> "$log"; exit 138' USR1
trap 'echo "coordinator got TERM" >> "$log"; exit 143' TERM
echo '{}' > "$dir/job.json"
touch "$STUB_DIR/started"
for _ in $(seq 600); do
    [ -f "$STUB_DIR/finish" ] && exit 0
    sleep 0.05
done
exit 99
"""

SRUN_STUB = """#!/bin/bash
echo "srun $*" >> "$STUB_DIR/calls"
"""

SCONTROL_STUB = """#!/bin/bash
echo "scontrol $*" >> "$STUB_DIR/calls"
if [ "$1 $2" = "show node" ]; then
    echo "NodeName=$3 Arch=x86_64 CoresPerSocket=56"
    echo "   NodeAddr=10.9.0.$STUB_ADDR NodeHostName=$3 Version=23.11"
fi
"""


@pytest.fixture
def stubs(tmp_path):
    bin_dir, stub_dir = tmp_path / "bin", tmp_path / "stub"
    bin_dir.mkdir()
    stub_dir.mkdir()
    for name, text in (("python", PY_STUB), ("srun", SRUN_STUB), ("scontrol", SCONTROL_STUB)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "DEADPOOL_"))}
    env = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PY": str(bin_dir / "python"),
           "STUB_DIR": str(stub_dir), "STUB_ADDR": "7", "SLURM_SUBMIT_DIR": str(ROOT),
           "SLURM_JOB_ID": "4242", "SLURMD_NODENAME": "gpu001", "RUN_DIR": str(tmp_path / "run")}
    return env, stub_dir


def start(env: dict, *overrides: str) -> subprocess.Popen:
    return subprocess.Popen(["bash", str(JOB), "model=tiny", *overrides], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def calls(stub_dir: Path) -> list[str]:
    f = stub_dir / "calls"
    return f.read_text().splitlines() if f.exists() else []


def line(stub_dir: Path, head: str) -> str:
    (found,) = [c for c in calls(stub_dir) if c.startswith(head)]
    return found


def wait_started(p: subprocess.Popen, stub_dir: Path) -> None:
    deadline = time.monotonic() + 30
    while not (stub_dir / "started").exists() or not any(c.startswith("srun") for c in calls(stub_dir)):
        assert p.poll() is None, p.stdout.read()
        assert time.monotonic() < deadline, calls(stub_dir)
        time.sleep(0.05)


def finish(p: subprocess.Popen, stub_dir: Path) -> tuple[int, str]:
    (stub_dir / "finish").touch()
    out, _ = p.communicate(timeout=60)
    return p.returncode, out


def test_templates_parse_and_the_8_gpu_one_asks_for_whole_nodes_that_survive_a_lost_node():
    for f in [*TEMPLATES, JOB, ROOT / "experiments/slurm/local_cluster.sh"]:
        p = subprocess.run(["bash", "-n", str(f)], capture_output=True, text=True)
        assert p.returncode == 0, (f, p.stderr)
    text = (ROOT / "experiments/slurm/deadpool_h100.sbatch").read_text()
    for opt in ("--no-kill", "--exclusive", "--ntasks-per-node=1", "--gpus-per-node=8",
                "--cpus-per-task=", "--signal=B:USR1@", "--requeue"):
        assert f"#SBATCH {opt}" in text, opt
    for f in TEMPLATES:
        assert "#SBATCH --no-kill" in f.read_text(), f


def test_coordinator_on_a_node_of_its_own_agents_on_the_others(stubs):
    """Three 8-GPU nodes, COORD_NODE=own: the coordinator on the batch host (gpu001, its store at
    the node's Slurm address), two node agents elsewhere with the fewest CPUs a node has, 16
    processes of which 8 spares: dp=8."""
    env, stub_dir = stubs
    env.update(SLURM_JOB_NUM_NODES="3", SLURM_NTASKS="3", SLURM_JOB_CPUS_PER_NODE="112(x2),96",
               SLURM_GPUS_PER_NODE="8", COORD_NODE="own", RANKS_PER_NODE="8", NUM_SPARES="8")
    env["STUB_NODES"] = "2"
    p = start(env)
    wait_started(p, stub_dir)
    rc, out = finish(p, stub_dir)
    assert rc == 0, out
    coord = line(stub_dir, "coordinator")
    assert "parallel.dp=8 " in coord and "parallel.ranks_per_node=8 " in coord and \
        "ft.num_spares=8 " in coord and "resume_from" not in coord, coord
    assert line(stub_dir, "store") == "store 10.9.0.7:29742"
    srun = line(stub_dir, "srun").split()
    for arg in ("--no-kill", "--kill-on-bad-exit=0", "--wait=0", "--exclude=gpu001", "--nodes=2",
                "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=96", "--gpus-per-node=8",
                "--node-from-env"):
        assert arg in srun, (arg, srun)


def test_the_batch_host_trains_too_by_default(stubs):
    """The local cluster's shape (test_slurm): five tasks on one node, each a process; the store
    host as given."""
    env, stub_dir = stubs
    env.update(SLURM_JOB_NUM_NODES="1", SLURM_NTASKS="5", SLURM_JOB_CPUS_PER_NODE="5", NUM_SPARES="1",
               DEADPOOL_STORE_HOST="127.0.0.1", SRUN_ARGS="")
    env["STUB_NODES"] = "1"
    p = start(env, "launcher.agents=true")
    wait_started(p, stub_dir)
    rc, out = finish(p, stub_dir)
    assert rc == 0, out
    assert "parallel.dp=4 " in line(stub_dir, "coordinator")
    assert line(stub_dir, "store").startswith("store 127.0.0.1:")
    srun = line(stub_dir, "srun").split()
    assert "--ntasks=1" in srun and "--cpus-per-task=5" in srun and not any(
        a.startswith("--exclude") for a in srun), srun


def test_usr1_reaches_the_coordinator_once_and_a_walltime_stop_is_requeued_to_resume(stubs):
    env, stub_dir = stubs
    env.update(SLURM_JOB_NUM_NODES="2", SLURM_NTASKS="16", SLURM_JOB_CPUS_PER_NODE="64(x2)",
               NUM_SPARES="8", REQUEUE="1", STUB_NODES="2")
    p = start(env)
    wait_started(p, stub_dir)
    p.send_signal(signal.SIGUSR1)  # --signal=B:USR1@T: the batch shell alone
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 128 + 10, out
    got = calls(stub_dir)
    assert got.count("coordinator got USR1") == 1, got
    assert "scontrol requeue 4242" in got, got
    # the requeued run: the same run dir, from its newest complete checkpoint
    (stub_dir / "calls").unlink()
    (stub_dir / "started").unlink()
    p = start({**env, "SLURM_RESTART_COUNT": "1"})
    wait_started(p, stub_dir)
    rc, out = finish(p, stub_dir)
    assert rc == 0 and "ft.resume_from=auto" in line(stub_dir, "coordinator"), out
    assert not any(c.startswith("scontrol requeue") for c in calls(stub_dir))


def test_term_is_not_forwarded_and_the_script_waits_for_the_coordinators_write(stubs):
    """Slurm's SIGTERM reaches the coordinator itself: a second signal from the script would stop
    it hard. The script must neither forward TERM nor die of it before the coordinator ends."""
    env, stub_dir = stubs
    env.update(SLURM_JOB_NUM_NODES="1", SLURM_NTASKS="4", SLURM_JOB_CPUS_PER_NODE="8", STUB_NODES="1",
               REQUEUE="1")
    p = start(env)
    wait_started(p, stub_dir)
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert p.poll() is None, p.stdout.read()
    rc, out = finish(p, stub_dir)
    assert rc == 0, out
    assert not any("got" in c or "requeue" in c for c in calls(stub_dir)), calls(stub_dir)
    assert "TERM" in out


def test_a_requeued_job_keeps_a_resume_the_user_gave(stubs):
    env, stub_dir = stubs
    env.update(SLURM_JOB_NUM_NODES="1", SLURM_NTASKS="4", STUB_NODES="1", SLURM_RESTART_COUNT="2")
    p = start(env, "ft.resume_from=/ckpt/step_100")
    wait_started(p, stub_dir)
    rc, out = finish(p, stub_dir)
    assert rc == 0, out
    coord = line(stub_dir, "coordinator")
    assert "ft.resume_from=/ckpt/step_100" in coord and "ft.resume_from=auto" not in coord
