"""The zygote server (``deadpool.launch.zygote_server``, ``launcher.zygote_server``): a job's
zygote forked from one pre-imported interpreter behaves as a zygote started as a new interpreter
(its children get what ``Popen`` would give them, their exits and its own reach the launcher),
its command line names the job file (``job_processes`` finds the job's processes), the server
refuses a socket others can reach, and a launcher whose server is gone starts the zygote itself.
The children run ``test_zygote``'s ``main``; the real agents' path runs in every integration job
(tests/conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from deadpool.launch import zygote_server
from deadpool.launch.launcher import job_processes
from deadpool.launch.zygote import ZygoteClient
from tests.deadpool.launch.test_zygote import ME, ROOT, wait_gone

ENV = dict(os.environ, PYTHONPATH=str(ROOT))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sock = tmp_path_factory.mktemp("zs") / "private" / "sock"
    proc = zygote_server.start(sock, preload=(), env=ENV)
    yield str(sock)
    proc.stdin.close()
    assert proc.wait(30) == 0  # the end of its stdin ends it
    assert not sock.exists()


def test_a_served_zygote_forks_children_as_a_new_one_does_and_is_found_by_its_job_file(
        server, tmp_path):
    run = tmp_path / "run dir"
    run.mkdir()
    z = ZygoteClient(run / "job.json", ENV, run / "zygote.log", preload=(), server=server)
    try:
        assert type(z.proc).__name__ == "ServedZygote"
        env = dict(ENV, DEADPOOL_TEST_MARK="served")
        child = z.spawn(ME, ["report", "3", "--x"], env, run / "c.log", name="dp-agent5")
        sleeper = z.spawn(ME, ["sleep", "60"], env, run / "s.log")
        assert child.wait(60) == 3
        got = json.loads((run / "c.log").read_text().splitlines()[0])
        assert got["argv"] == ["report", "3", "--x"] and got["env"] == env
        assert got["sid"] == got["pgid"] == child.pid
        # the zygote's command line is the job's, and its children inherit it
        cmd = Path(f"/proc/{z.proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert cmd[1:5] == [b"-m", b"deadpool.launch.zygote", b"--job",
                            str(run / "job.json").encode()]
        assert set(job_processes(run)) == {z.proc.pid, sleeper.pid}
        # SIGPIPE ignored as in a new interpreter (else a write to a dead peer's socket kills)
        for pid in (z.proc.pid, sleeper.pid):
            ignored = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text()
                               .splitlines() if line.startswith("SigIgn:")), 16)
            assert ignored >> (signal.SIGPIPE - 1) & 1, (pid, hex(ignored))
        os.kill(sleeper.pid, 9)
        assert sleeper.wait(30) == -9
        assert z.proc.wait(30) == 0  # it leaves with its last child, as a new one does
        assert wait_gone([z.proc.pid, sleeper.pid, child.pid], 5.0) == []
    finally:
        z.close(timeout_s=10.0, kill=True)


def test_a_launcher_whose_server_is_gone_starts_the_zygote_itself(tmp_path, capsys):
    z = ZygoteClient(tmp_path / "job.json", ENV, tmp_path / "zygote.log", preload=(),
                     server=str(tmp_path / "nobody-here"))
    try:
        assert isinstance(z.proc, subprocess.Popen)
        assert "starting the zygote as a new interpreter" in capsys.readouterr().out
        child = z.spawn(ME, ["report", "0"], ENV, tmp_path / "c.log")
        assert child.wait(60) == 0
    finally:
        z.close(timeout_s=10.0)


def test_a_socket_others_can_reach_is_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(RuntimeError, match="did not start"):
        zygote_server.start(shared / "sock", preload=(), env=ENV, timeout_s=60)
    assert not (shared / "sock").exists()


def test_a_command_line_longer_than_the_room_is_refused_before_any_fork(server, tmp_path):
    """Its processes could not be found by the job file: the launcher starts the zygote itself."""
    long = tmp_path / ("d" * 200) / ("e" * 200)
    for _ in range(25):  # (never made: only its name travels)
        long = long / ("f" * 200)
    z = ZygoteClient(long / "job.json", ENV, tmp_path / "zygote.log", preload=(), server=server)
    try:
        assert isinstance(z.proc, subprocess.Popen)
    finally:
        z.close(timeout_s=10.0)
