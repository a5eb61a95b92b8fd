"""The zygote (``deadpool.launch.zygote``, ``launcher.fork_agents``): a process it forks gets what
``Popen`` would give it (argv, environment, log, a session of its own), its exit code and a
SIGKILL reach the launcher through ``poll``/``wait``, and the zygote leaves nothing behind when
the launcher closes it or dies. The children here run this module's ``main`` (the zygote imports
it by name), not an agent: the real agents' path runs in every integration job (tests/conftest.py
FORKED)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deadpool.launch.launcher import AgentLauncher
from deadpool.launch.zygote import ZygoteClient

ROOT = Path(__file__).resolve().parents[3]
ME = "tests.deadpool.launch.test_zygote"
NO_PRELOAD = ()  # (the agent's imports cost ~2 s of CPU and are not what is tested here)


def main(argv) -> int:
    """A child: ``report CODE`` prints what it was given and exits CODE; ``sleep S`` sleeps."""
    if argv[0] == "sleep":
        time.sleep(float(argv[1]))
        return 0
    print(json.dumps({"argv": sys.argv[1:], "env": dict(os.environ), "pid": os.getpid(),
                      "sid": os.getsid(0), "pgid": os.getpgid(0)}), flush=True)
    return int(argv[1])


def gone(pid: int) -> bool:
    """Exited (a zombie counts: nothing of it runs, and a container's init may not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except OSError:
        return True


def wait_gone(pids, timeout_s: float = 20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(not gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if not gone(p)]


@pytest.fixture
def zygote(tmp_path):
    z = ZygoteClient(tmp_path / "job.json", dict(os.environ, PYTHONPATH=str(ROOT)),
                     tmp_path / "zygote.log", preload=NO_PRELOAD)
    yield z
    z.close(timeout_s=10.0, kill=z.proc.poll() is None and any(
        c.poll() is None for c in z.children.values()))


def test_a_forked_child_gets_the_argv_env_log_and_session_a_popen_one_gets(zygote, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), DEADPOOL_TEST_MARK="zygote-env")
    env.pop("DEADPOOL_ABSENT", None)
    argv = ["report", "0", "--job", "x y.json"]
    log_f, log_p = tmp_path / "forked.log", tmp_path / "popen.log"
    log_f.write_text("before\n")
    log_p.write_text("before\n")
    child = zygote.spawn(ME, argv, env, log_f, name="dp-agent7")
    assert child.wait(60) == 0
    p = subprocess.Popen([sys.executable, "-m", ME, *argv], stdout=open(log_p, "a"),
                         stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=ROOT)
    assert p.wait(60) == 0
    forked, popened = (f.read_text().splitlines() for f in (log_f, log_p))
    assert forked[0] == popened[0] == "before"  # appended, not truncated
    f, q = json.loads(forked[1]), json.loads(popened[1])
    assert f["argv"] == q["argv"] == argv
    assert f["env"] == env  # the whole environment, nothing of the zygote's (or the launcher's)
    assert f["sid"] == f["pgid"] == child.pid and q["sid"] == q["pgid"] == p.pid  # own session


def test_exit_codes_and_a_sigkill_are_seen_through_poll_and_wait(zygote, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    sleeper = zygote.spawn(ME, ["sleep", "60"], env, tmp_path / "b.log")
    three = zygote.spawn(ME, ["report", "3"], env, tmp_path / "a.log")
    assert three.wait(60) == 3 and three.poll() == 3 and three.returncode == 3
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.3)
    os.kill(sleeper.pid, signal.SIGKILL)
    assert sleeper.wait(30) == -signal.SIGKILL
    assert sleeper.poll() == -9
    # its last child gone, the zygote leaves although its stdin is open (a stopped coordinator
    # must not keep it: test_preemption's SIGTERM to the agents of a stopped coordinator)
    assert zygote.proc.wait(30) == 0
    with pytest.raises(RuntimeError):  # (the launcher then starts that one by Popen)
        zygote.spawn(ME, ["sleep", "1"], env, tmp_path / "c.log")


def test_closing_the_zygote_leaves_no_process_once_its_children_have_exited(zygote, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = zygote.spawn(ME, ["sleep", "1.5"], env, tmp_path / "c.log")
    t0 = time.monotonic()
    zygote.close(timeout_s=30.0)  # returns when the zygote exited: after its child, not before
    assert time.monotonic() - t0 > 0.5
    assert zygote.proc.returncode == 0
    assert child.returncode == 0  # reported before the zygote left
    assert wait_gone([child.pid, zygote.proc.pid], 2.0) == []


LAUNCHER = """
import os, sys, time
from pathlib import Path
from deadpool.launch.zygote import ZygoteClient
d = Path(sys.argv[1])
z = ZygoteClient(d / "job.json", dict(os.environ), d / "zygote.log", preload=())
c = z.spawn("tests.deadpool.launch.test_zygote", ["sleep", "1.5"], dict(os.environ), d / "c.log")
print(z.proc.pid, c.pid, flush=True)
time.sleep(600)
"""


def test_a_sigkilled_launcher_leaves_no_process_once_the_zygotes_children_have_exited(tmp_path):
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(tmp_path)], cwd=ROOT,
                                stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        zygote, child = map(int, launcher.stdout.readline().split())
    finally:
        launcher.kill()
        launcher.wait()
    assert not gone(child)  # the child outlives the launcher, as a Popen'd agent would
    assert wait_gone([child, zygote]) == [], "the zygote or its child outlived the launcher"


def test_a_zygote_that_cannot_start_falls_back_to_new_interpreters(tmp_path, monkeypatch,
                                                                    capsys):
    def broken(*a, **k):
        raise RuntimeError("no zygote here")

    monkeypatch.setattr("deadpool.launch.launcher.ZygoteClient", broken)
    launcher = AgentLauncher.__new__(AgentLauncher)
    launcher.run_dir, launcher.job_json, launcher.secret = tmp_path, tmp_path / "job.json", None
    launcher.zygote, launcher.zygote_server = None, None  # launcher.fork_agents=true
    assert launcher._forked(["--node", "0"], {}, tmp_path / "agent0.log", 0) is None
    assert launcher.zygote is False  # Popen from then on, for this job
    assert "no zygote here" in capsys.readouterr().err


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
