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
