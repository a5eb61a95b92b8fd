"""DeadPool launched through a real Slurm: the template's job body (experiments/slurm/
deadpool_job.sh, which every template runs) on a single-node cluster started by
experiments/slurm/local_cluster.sh, in CPU mode with 4 workers + 1 warm spare. One rank's process
is SIGKILLed from outside mid-run; the spare must be hot-swapped in, the step must survive the
dead process, and the final state must be bitwise equal to a failure-free run of the same seed.

Twice: with node agents (the default: srun starts one agent, the node's five processes are its
children) and without (launcher.agents=false: srun starts the five processes as its tasks). And a
node's loss: three agents on the one machine, one SIGKILLed with its two ranks. And a walltime
stop: USR1 to the batch shell, the state written, the job requeued and resumed. And on a cluster
of four nodes (four slurmd on this machine): the coordinator on a node of its own, and a node lost
as on a cluster, which Slurm marks DOWN while the job goes on (--no-kill).

The fixture installs Debian's slurm-wlm and munge when they are missing and this runs as root
(CI does); elsewhere without Slurm the test is skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deadpool.launch.config import compose_config
from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states

# the module fixture may install and start Slurm (up to 900 s) inside the first test's timeout
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "experiments/slurm/local_cluster.sh"
JOB = ROOT / "experiments/slurm/deadpool_job.sh"
STEPS = 40  # rank 0 past step 10 when the fault lands; 30 steps to go leaves it mid-run
OVERRIDES = ["model=tiny", f"num_steps={STEPS}", "log_every_steps=2", "seed=4321"]


def local_cluster(tmp_path_factory, nodes: int):
    """A local Slurm of ``nodes`` nodes (one slurmd each on this machine), its environment; stopped
    when the generator is closed."""
    if shutil.which("slurmctld") is None and os.geteuid() != 0:
        pytest.skip("Slurm is not installed and installing it needs root")
    state = tmp_path_factory.mktemp("slurm")
    env = {**os.environ, "DEADPOOL_SLURM_DIR": str(state), "DEADPOOL_SLURMCTLD_PORT": str(free_port()),
           "DEADPOOL_SLURMD_PORT": str(free_ports(nodes)), "DEADPOOL_SLURM_NODES": str(nodes)}
    p = subprocess.run(["bash", str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    env["SLURM_CONF"] = str(state / "etc/slurm.conf")
    yield env
    subprocess.run(["bash", str(CLUSTER), "stop"], env=env, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def slurm_env(tmp_path_factory):
    yield from local_cluster(tmp_path_factory, 1)


@pytest.fixture(scope="module")
def slurm_nodes_env(tmp_path_factory):
    """Four nodes dp0 .. dp3, each its own slurmd (local_cluster.sh, DEADPOOL_SLURM_NODES)."""
    yield from local_cluster(tmp_path_factory, 4)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports."""
    for _ in range(100):
        first = free_port()
        socks = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def job_state(env: dict, job_id: str) -> tuple[str, int]:
    """A job's state and how often it was requeued (scontrol keeps a finished job a while; a
    busy slurmctld may not answer: then the state is unknown)."""
    p = subprocess.run(["scontrol", "show", "job", "-o", job_id], env=env, capture_output=True, text=True)
    fields = dict(f.split("=", 1) for f in p.stdout.split() if "=" in f)
    return fields.get("JobState", "UNKNOWN"), int(fields.get("Restarts", -1))


def wait_for(what, timeout_s: float, env: dict, job_id: str, log: Path, ended=()) -> None:
    """Until ``what()``; a job state in ``ended`` fails at once (while a job is requeued it
    passes through CANCELLED)."""
    deadline = time.monotonic() + timeout_s
    while not what():
        state = job_state(env, job_id)
        assert time.monotonic() < deadline and state[0] not in ended, \
            (state, log.read_text() if log.exists() else "no job log")
        time.sleep(0.2)


def job_processes(job_id: str, module: bytes) -> dict[int, dict[str, str]]:
    """pid -> environment of job ``job_id``'s Python processes running ``module``
    (``python -m <module>``; not srun, whose command line names it too)."""
    found = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if module not in argv or b"-m" not in argv or argv[0].endswith(b"srun"):
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except OSError:
            continue
        if env.get("SLURM_JOB_ID") == job_id:
            found[int(d.name)] = env
    return found


def slot_pid(job_id: str, slot: int) -> int | None:
    """The PID of job ``job_id``'s process of launch slot ``slot`` (a deadpool.rank.worker process):
    started with ``--slot <slot>`` by its node agent, or an srun task with SLURM_PROCID=<slot>
    (``--slot-from-env``)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
            if b"deadpool.rank.worker" not in argv:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except OSError:
            continue
        if env.get("SLURM_JOB_ID") != job_id:
            continue
        if (b"--slot" in argv and argv[argv.index(b"--slot") + 1] == str(slot).encode()) or \
                (b"--slot-from-env" in argv and env.get("SLURM_PROCID") == str(slot)):
            return int(d.name)
    return None


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def finished(squeue, deadline: float, log: Path, run_dir: Path) -> dict:
    """Wait for the Slurm job to leave the queue; its coordinator exited 0 and the job completed.
    Returns its summary."""
    while squeue():
        assert time.time() < deadline, log.read_text()
        time.sleep(1)
    text = log.read_text()
    assert "coordinator exit 0" in text, text
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed", s.get("message")
    return s


def newest_step(*logs: Path) -> int:
    """The newest step rank 0 reported (``[rank 0] step   12/100 ...``): in the job's output
    (srun tasks) or in slot 0's log (a node agent's child)."""
    texts = [log.read_text() for log in logs if log.exists()]
    return max((int(m) for t in texts for m in re.findall(r"\[rank 0\] step\s+(\d+)/", t)), default=0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The failure-free run both tests compare with (local launcher, same seed and layout)."""
    run_dir = tmp_path_factory.mktemp("reference")
    ref = compose_config(OVERRIDES + ["parallel.dp=4", "ft.num_spares=1", "launcher.fork_workers=true"],
                         run_dir)  # (forked: nothing reads its processes' command lines)
    assert run_job(ref, log=lambda *a, **k: None)["outcome"] == "completed"
    return run_dir


@pytest.mark.parametrize("agents", [True, False], ids=["agents", "srun-tasks"])
def test_rank_sigkilled_spare_hot_swapped_bitwise(slurm_env, reference, tmp_path, agents):
    run_dir = tmp_path / "slurm_run"
    env = {**slurm_env, "NUM_SPARES": "1", "DEVICE": "cpu", "SRUN_ARGS": "", "PY": sys.executable,
           "RUN_DIR": str(run_dir), "DEADPOOL_STORE_PORT": str(free_port()),
           "DEADPOOL_STORE_HOST": "127.0.0.1"}  # one node: no need for the host name to resolve
    out = tmp_path / "slurm-%j.out"
    p = subprocess.run(["sbatch", "--parsable", "--ntasks=5", f"--output={out}", f"--chdir={ROOT}", str(JOB),
                        *OVERRIDES, f"launcher.agents={str(agents).lower()}"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    job_id = p.stdout.strip().split(";")[0]
    log = Path(str(out).replace("%j", job_id))

    def squeue() -> str:
        return subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True).stdout

    deadline = time.time() + 180
    while newest_step(log, run_dir / "logs/slot0.log") < 10:  # under way: kill rank 1 from outside
        assert time.time() < deadline and squeue(), log.read_text() if log.exists() else "no job log"
        time.sleep(0.2)
    pid = slot_pid(job_id, 1)
    assert pid is not None, f"no process of slot 1 in job {job_id}: " + subprocess.run(
        ["ps", "-eo", "pid,ppid,args"], capture_output=True, text=True).stdout[-3000:]
    parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    if agents:  # the rank is a child of the node's agent, itself the step's one srun task
        assert "deadpool.agent" in cmdline(parent) and "--node-from-env" in cmdline(parent), cmdline(parent)
        assert b"SLURM_PROCID=" not in Path(f"/proc/{pid}/environ").read_bytes()  # the agent's task only
    else:
        assert "deadpool.agent" not in cmdline(parent)
    t_sent = time.time()
    os.kill(pid, signal.SIGKILL)
    s = finished(squeue, deadline + 120, log, run_dir)
    (rec,) = s["recoveries"]
    assert rec["failed_rank"] == 1 and rec["spare_slot"] in (4, [4]), rec
    assert rec["outcome"] == "hot-swapped", rec
    # with agents the exit is seen by the rank's agent (waitpid) and recorded at once; as srun tasks
    # nothing shows it: the survivors' broken collective aborts the generation and the rank that
    # neither answers nor beats is declared lost (soft heartbeat timeout)
    first_step = rec["t_kill"] + rec["kill_to_first_step_s"]  # t_kill unknown to the runtime: t_detect
    print(f"[slurm agents={agents}] SIGKILL -> first step {first_step - t_sent:.2f} s "
          f"(detected by {rec['detected_by']})")
    equal, why = compare_final_states(run_dir, reference)
    assert equal, why


def test_a_killed_node_agent_loses_its_node_and_spares_take_both_ranks(slurm_env, reference, tmp_path):
    """Three node agents of two slots on the one machine (AGENTS_PER_HOST=3: the srun step's tasks
    0, 1, 2 are nodes 0, 1, 2): ranks 0, 1 | ranks 2, 3 | spares 4, 5. Node 1's agent is SIGKILLed
    from outside; its ranks die with it, the coordinator (no handle on any agent) sees node 1's
    record fall silent, and both spares take its ranks."""
    run_dir = tmp_path / "slurm_run"
    env = {**slurm_env, "NUM_SPARES": "2", "RANKS_PER_NODE": "2", "AGENTS_PER_HOST": "3", "DEVICE": "cpu",
           "SRUN_ARGS": "", "PY": sys.executable, "RUN_DIR": str(run_dir),
           "DEADPOOL_STORE_PORT": str(free_port()), "DEADPOOL_STORE_HOST": "127.0.0.1"}
    out = tmp_path / "slurm-%j.out"
    p = subprocess.run(["sbatch", "--parsable", "--ntasks=6", f"--output={out}", f"--chdir={ROOT}", str(JOB),
                        *OVERRIDES], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    job_id = p.stdout.strip().split(";")[0]
    log = Path(str(out).replace("%j", job_id))

    def squeue() -> str:
        return subprocess.run(["squeue", "-h", "-j", job_id], env=env, capture_output=True, text=True).stdout

    deadline = time.time() + 180
    while newest_step(log, run_dir / "logs/slot0.log") < 10:
        assert time.time() < deadline and squeue(), log.read_text() if log.exists() else "no job log"
        time.sleep(0.2)
    ranks = {slot: slot_pid(job_id, slot) for slot in range(6)}
    assert None not in ranks.values(), ranks
    agent = int(Path(f"/proc/{ranks[2]}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert "deadpool.agent" in cmdline(agent), cmdline(agent)
    assert b"SLURM_PROCID=1\0" in Path(f"/proc/{agent}/environ").read_bytes()  # node 1's agent
    os.kill(agent, signal.SIGKILL)
    s = finished(squeue, deadline + 120, log, run_dir)
    (rec,) = s["recoveries"]
    assert set(rec["failed_rank"]) == {2, 3} and rec["outcome"] == "hot-swapped", rec
    print(f"[slurm node loss] detected by {rec['detected_by']}, kill to first step "
          f"{rec['kill_to_first_step_s']:.2f} s")
    equal, why = compare_final_states(run_dir, reference)
    assert equal, why


def test_walltime_signal_writes_the_state_requeues_and_the_job_resumes_bitwise(slurm_env, reference, tmp_path):
    """The batch shell alone gets USR1 (as `--signal=B:USR1@T` sends it before the time limit;
    here `scancel -b`): the job body hands it to the coordinator, which writes the newest step in
    memory and stops (exit 128 + 10); the job requeues itself (REQUEUE=1) and its second run,
    in the same run directory, resumes with ft.resume_from=auto and ends bitwise equal to a
    failure-free run."""
    run_dir = tmp_path / "slurm_run"
    env = {**slurm_env, "NUM_SPARES": "1", "DEVICE": "cpu", "SRUN_ARGS": "", "PY": sys.executable,
           "RUN_DIR": str(run_dir), "DEADPOOL_STORE_PORT": str(free_port()),
           "DEADPOOL_STORE_HOST": "127.0.0.1", "REQUEUE": "1"}
    out = tmp_path / "slurm-%j.out"
    p = subprocess.run(["sbatch", "--parsable", "--ntasks=5", "--requeue", "--open-mode=append",
                        f"--output={out}", f"--chdir={ROOT}", str(JOB), *OVERRIDES,
                        "launcher.fork_workers=true"],  # (no process looked up: the agents fork)
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    job_id = p.stdout.strip().split(";")[0]
    log = Path(str(out).replace("%j", job_id))

    wait_for(lambda: newest_step(log, run_dir / "logs/slot0.log") >= 10, 180, env, job_id, log)
    subprocess.run(["scancel", "-b", "-s", "USR1", job_id], env=env, check=True, timeout=30)
    wait_for(lambda: job_state(env, job_id) == ("PENDING", 1), 120, env, job_id, log)
    text = log.read_text()
    assert "coordinator exit 138" in text and "requeueing job" in text, text
    assert text.count("USR1: asking the coordinator") == 1, text
    stopped = json.loads((run_dir / "summary.json").read_text())
    assert stopped["outcome"] == "preempted", stopped.get("message")
    # Slurm holds a requeued job back for a job credential's lifetime (local_cluster.sh: 15 s)
    wait_for(lambda: job_state(env, job_id)[0] == "COMPLETED", 300, env, job_id, log,
             ended=("FAILED", "CANCELLED", "TIMEOUT"))
    text = log.read_text()
    assert "(restart 1)" in text and "ft.resume_from=auto: resuming from the checkpoint of step" in text, text
    assert "coordinator exit 0;" in text.split("(restart 1)")[1], text[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed" and s["recoveries"] == [], s
    equal, why = compare_final_states(run_dir, reference)
    assert equal, why


def test_coordinator_alone_on_its_node_and_a_node_slurm_marks_down_leaves_the_job_running(
        slurm_nodes_env, reference, tmp_path):
    """Four nodes, COORD_NODE=own: the coordinator on the batch host dp0 (its store at dp0's
    NodeAddr, not loopback), node agents of two slots on dp1 .. dp3 (ranks 0, 1 | ranks 2, 3 |
    spares 4, 5). The node of agent 1 is lost as on a cluster: its slurmd, step daemon and agent
    SIGKILLed, and Slurm marks it DOWN. Without `--no-kill` (sbatch's and srun's) Slurm would end
    the job, or the whole agents' step; with it the node is only removed from the job, the
    spare node takes both ranks and the job ends bitwise equal to a failure-free run."""
    env = slurm_nodes_env
    conf = Path(env["SLURM_CONF"]).read_text()
    if "NodeAddr=127." in conf:
        pytest.skip("no non-loopback IPv4 address on this machine for the nodes' store")
    run_dir = tmp_path / "slurm_run"
    env = {**env, "COORD_NODE": "own", "NUM_SPARES": "2", "RANKS_PER_NODE": "2", "DEVICE": "cpu",
           "SRUN_ARGS": "", "PY": sys.executable, "RUN_DIR": str(run_dir),
           "DEADPOOL_STORE_PORT": str(free_port())}
    env.pop("DEADPOOL_STORE_HOST", None)
    out = tmp_path / "slurm-%j.out"
    p = subprocess.run(["sbatch", "--parsable", "--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=2",
                        "--no-kill", f"--output={out}", f"--chdir={ROOT}", str(JOB), *OVERRIDES],
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    job_id = p.stdout.strip().split(";")[0]
    log = Path(str(out).replace("%j", job_id))
    wait_for(lambda: newest_step(log, run_dir / "logs/slot0.log") >= 10, 180, env, job_id, log)
    (coord,) = job_processes(job_id, b"deadpool.train").values()
    assert coord["SLURMD_NODENAME"] == "dp0", coord["SLURMD_NODENAME"]
    agents = {int(e["SLURM_PROCID"]): (pid, e["SLURMD_NODENAME"])
              for pid, e in job_processes(job_id, b"deadpool.agent").items()}
    assert sorted(agents) == [0, 1, 2] and {n for _, n in agents.values()} == {"dp1", "dp2", "dp3"}, agents
    ranks = job_processes(job_id, b"deadpool.rank.worker")
    assert len(ranks) == 6 and all(e["SLURMD_NODENAME"] != "dp0" for e in ranks.values())
    pid, node = agents[1]
    stepd = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    slurmd = int((Path(env["DEADPOOL_SLURM_DIR"]) / f"slurmd-{node}.pid").read_text())
    for victim in (slurmd, stepd, pid):
        os.kill(victim, signal.SIGKILL)
    subprocess.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=lost in a test"],
                   env=env, check=True, timeout=30)
    wait_for(lambda: job_state(env, job_id)[0] == "COMPLETED", 240, env, job_id, log,
             ended=("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PENDING"))
    ctld = (Path(env["DEADPOOL_SLURM_DIR"]) / "log/slurmctld.log").read_text()
    assert f"Removing failed node {node} from JobId={job_id}" in ctld, ctld[-3000:]
    text = log.read_text()
    assert "coordinator exit 0;" in text, text[-3000:]
    s = json.loads((run_dir / "summary.json").read_text())
    assert s["outcome"] == "completed", s.get("message")
    (rec,) = s["recoveries"]
    assert set(rec["failed_rank"]) == {2, 3} and rec["outcome"] == "hot-swapped", rec
    print(f"[slurm node down] detected by {rec['detected_by']}, kill to first step "
          f"{rec['kill_to_first_step_s']:.2f} s")
    equal, why = compare_final_states(run_dir, reference)
    assert equal, why


def test_simulator_sweep_through_hydra_submitit_slurm(slurm_env, tmp_path):
    """Two sweep points of sim/conf/experiment/sim_scale.yaml, each a Slurm job submitted by Hydra's
    submitit launcher (hydra/launcher=sim_slurm), on the same cluster."""
    sweep = tmp_path / "sweep"
    p = subprocess.run([sys.executable, "-m", "sim.run", "-m", "experiment=sim_scale", "hydra/launcher=sim_slurm",
                        "seeds=1", "duration_days=1", "cluster.num_gpus=1024,4096", f"hydra.sweep.dir={sweep}",
                        "progress=false"], cwd=ROOT, env=slurm_env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    import yaml  # every strategy the scenario runs (sim/conf/sim.yaml's list): a row each

    want = set(yaml.safe_load((ROOT / "sim" / "conf" / "sim.yaml").read_text())["strategies"])
    for point in ("0", "1"):
        rows = (sweep / point / "aggregate.csv").read_text().splitlines()
        assert {r.split(",")[0] for r in rows[1:]} == want and len(rows) == 1 + len(want), rows
    assert list((sweep / ".submitit").iterdir()), "no submitit job folders: the points did not go through Slurm"
