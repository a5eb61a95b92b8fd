"""The local launcher: process handles, stop detection (for the soft heartbeat timeout), fencing."""

import pytest


@pytest.mark.slow
def test_local_launcher_sees_a_stopped_process(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from deadpool.launch.launcher import LocalLauncher

    la = LocalLauncher(tmp_path, tmp_path / "job.json")
    la.procs[0] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not la.is_stopped(0)
        la.procs[0].send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 30  # the kernel's state change, not a fixed delay
        while not la.is_stopped(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert la.is_stopped(0)
    finally:
        la.kill(0)
        la.procs[0].wait()
    assert la.is_stopped(0)  # gone counts as stopped


def test_share_gpu_gives_each_process_its_own_nccl_host_and_loopback_sockets(tmp_path, monkeypatch):
    import subprocess

    from deadpool.launch.launcher import LocalLauncher

    started = []

    class Popen:
        def __init__(self, cmd, env, **kw):
            started.append(env)

    monkeypatch.setattr(subprocess, "Popen", Popen)
    LocalLauncher(tmp_path, tmp_path / "job.json", share_gpu=True).start([0, 1, 2])
    hosts = [env["NCCL_HOSTID"] for env in started]
    assert len(set(hosts)) == 3  # distinct: NCCL then treats the ranks as separate hosts
    assert all(env["NCCL_NET"] == "Socket" and env["NCCL_SOCKET_IFNAME"] == "lo"
               and env["NCCL_IB_DISABLE"] == "1" and env["NCCL_NVLS_ENABLE"] == "0"
               for env in started)
    started.clear()
    LocalLauncher(tmp_path, tmp_path / "job.json").start([0, 1])
    assert not any("NCCL_HOSTID" in env for env in started)  # only in the test mode


# fork_main forks the process that calls it, so each case runs in a fresh interpreter of its own
# (the test process runs threads of earlier tests, which fork_main refuses)
FORK_SCRIPT = r'''
import json, os, signal, subprocess, sys, threading, time, types
from pathlib import Path
from deadpool.launch.procs import fork_main

log = Path(sys.argv[1])
held = os.open(sys.argv[1] + ".held", os.O_WRONLY | os.O_CREAT)  # a descriptor of the parent's
signal.signal(signal.SIGTERM, lambda *a: None)  # a handler of the parent's
mod = types.SimpleNamespace(T_EXEC=None, __file__="worker.py")

def child(argv):
    try:
        os.fstat(held)
        kept = True
    except OSError:
        kept = False
    print(json.dumps({"argv": argv, "sys_argv": sys.argv, "env": dict(os.environ),
                      "sid_is_pid": os.getsid(0) == os.getpid(), "kept_fd": kept,
                      "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
                      "t_exec": mod.T_EXEC,
                      "comm": Path("/proc/self/comm").read_text().strip()}))
    if argv[0] == "sleep":
        time.sleep(30)
    if argv[0] == "raise":
        raise ValueError("boom in the child")
    sys.exit(int(argv[0]))

out = {}
p = fork_main(child, ["3"], log, {"ONLY": "this"}, t_exec=12.5, module=mod, name="dp-slot7")
out["code"] = p.wait()
p = fork_main(child, ["raise"], log, {})
out["raise"] = p.wait()
p = fork_main(child, ["sleep"], log, {})
try:
    p.wait(timeout=0.2)
    out["timed_out"] = False
except subprocess.TimeoutExpired:
    out["timed_out"] = True
out["poll_running"] = p.poll()
os.kill(p.pid, signal.SIGKILL)
out["killed"] = p.wait()
out["poll_after"] = p.poll()
threading.Thread(target=time.sleep, args=(5,), daemon=True).start()
try:
    fork_main(child, ["0"], log, {})
    out["refused"] = False
except RuntimeError as e:
    out["refused"] = "threads" in str(e)
print(json.dumps(out))
'''


def test_fork_main_runs_main_as_a_new_interpreter_would_and_reports_like_popen(tmp_path):
    import json
    import subprocess
    import sys

    log = tmp_path / "child.log"
    res = subprocess.run([sys.executable, "-c", FORK_SCRIPT, str(log)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    # SystemExit's code, an exception's 1, a signal's -signum, and Popen's wait/poll contract
    assert out == {"code": 3, "raise": 1, "timed_out": True, "poll_running": None, "killed": -9,
                   "poll_after": -9, "refused": True}
    lines = log.read_text().splitlines()
    first = json.loads(lines[0])
    assert first["argv"] == ["3"] and first["sys_argv"] == ["worker.py", "3"]
    assert first["env"] == {"ONLY": "this"}  # the given environment, nothing of the parent's
    assert first["sid_is_pid"] and not first["kept_fd"] and first["sigterm_default"]
    assert first["t_exec"] == 12.5 and first["comm"] == "dp-slot7"
    assert "ValueError: boom in the child" in log.read_text()  # stderr goes to the log too
    assert res.stdout.count("argv") == 0  # nothing of the children reached the parent's stdout
