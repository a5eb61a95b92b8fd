"""The local launcher: process handles, stop detection (for the soft heartbeat timeout), fencing."""

import pytest


@pytest.mark.slow
def test_local_launcher_sees_a_stopped_process(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from deadpool.launcher import LocalLauncher

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

    from deadpool.launcher import LocalLauncher

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
