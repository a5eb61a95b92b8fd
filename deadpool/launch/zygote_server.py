"""A fork server of zygotes: ``python -m deadpool.launch.zygote_server --socket PATH``.

``launcher.fork_agents`` starts one zygote per job (``deadpool.launch.zygote``), a new interpreter
that imports torch and the worker before it forks the job's agents: ~3.5 s of CPU and of start-up
wall time per job on a 2-core machine, most of a short job's start. Whoever starts many jobs
from one machine (the test suite, the fault campaign, a sweep) can keep one pre-imported
interpreter instead, and name its socket in ``launcher.zygote_server``: each job's zygote is then
a fork of it, not a new interpreter. What the launcher sees is the same zygote (its stdin and
stdout protocol, its reaping of the agents, its command line naming the job file).

Protocol: a ``SOCK_SEQPACKET`` Unix socket; per job one message, a JSON object ``{"argv",
"env", "cwd", "log"}`` carrying two descriptors (the zygote's stdin and stdout pipe ends), and
one answer, ``<pid>`` or ``failed <why>``. The forked zygote gets the descriptors as its stdin
and stdout, ``log`` as stderr, ``env`` as its whole environment, a session of its own, and
``argv`` as its command line (written over this server's, which is padded for it: the job's
processes are found by command line, ``launcher.job_processes``). The server is single-threaded
(the fork copies no lock another thread holds), reaps its zygotes, and leaves at the end of its
stdin (its owner is gone) or on SIGTERM; the zygotes live on until their jobs end.

The socket is created under a directory only its user can enter (the request carries the job's
secret in ``env``); a socket whose directory others can reach is refused."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import socket
import stat
import sys
from pathlib import Path

from deadpool.launch.procs import _close_descriptors_from
from deadpool.launch.zygote import PRELOAD, Zygote, wait_ready

PAD = 4096  # bytes of command line the server keeps for its zygotes' (a job file's path and more)
MAX_REQUEST = 1 << 20


def private_socket_dir(path: Path) -> None:
    """Refuse a socket whose directory another user can reach (or that is not this user's)."""
    st = path.parent.stat()
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"{path.parent}: must be this user's and mode 0700 "
                              "(a zygote server forks processes with the requests' secrets)")


def _arg_area() -> tuple[int, int]:
    """Where this process's command line lies in its memory (what ``/proc/self/cmdline`` reads)."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[45]), int(fields[46])  # arg_start, arg_end (proc(5) fields 48, 49)


def _command_line(argv: list[str], room: int) -> bytes:
    data = b"\0".join(a.encode() for a in argv) + b"\0"
    if len(data) > room:  # (refused before the fork: a job whose processes no search could find)
        raise ValueError(f"a command line of {len(data)} bytes, room for {room}")
    return data.ljust(room, b"\0")


def set_command_line(argv: list[str]) -> None:
    """Write ``argv`` over this process's command line; ValueError when it does not fit."""
    start, end = _arg_area()
    data = _command_line(argv, end - start)
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(data)


def _zygote_main(req: dict, fds: list[int]) -> int:
    """In the forked child: become the job's zygote."""
    signal.set_wakeup_fd(-1)  # (the server's; the zygote sets its own)
    os.dup2(fds[0], 0)
    os.dup2(fds[1], 1)
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 2)
    _close_descriptors_from(3)
    os.setsid()
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    # SIGPIPE ignored, as a new interpreter has it: under SIG_DFL a write to a dead peer's socket
    # (gloo, the store) killed the zygote's ranks silently, with the killed rank they talked to
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    set_command_line(req["argv"])
    sys.stdout.reconfigure(line_buffering=True)
    return Zygote().run()


def _fork_zygote(req: dict, fds: list[int]) -> int:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        code = _zygote_main(req, fds)
    except BaseException:  # (printed to the job's zygote log)
        import traceback
        traceback.print_exc()
    finally:
        os._exit(code)


def serve(path: Path, preload=PRELOAD) -> int:
    for name in preload:
        importlib.import_module(name)
    private_socket_dir(path)
    path.unlink(missing_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    srv.bind(str(path))
    os.chmod(path, 0o600)
    srv.listen(64)
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    signal.signal(signal.SIGCHLD, lambda *a: None)
    signal.set_wakeup_fd(w)
    stop = []
    signal.signal(signal.SIGTERM, lambda *a: stop.append(1))
    os.write(1, b"ready\n")
    children: set[int] = set()
    try:
        while not stop:
            ready = wait_ready([srv, 0], r)
            while children:  # reap the zygotes that ended
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if not pid:
                    break
                children.discard(pid)
            if 0 in ready and not os.read(0, 4096):
                break  # the owner is gone
            if srv in ready:
                children.update(_answer(srv))
    finally:
        srv.close()
        path.unlink(missing_ok=True)
    return 0


def _answer(srv: socket.socket) -> list[int]:
    conn, _ = srv.accept()
    fds: list[int] = []
    with conn:
        try:
            msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 2)
            req = json.loads(msg)
            if len(fds) != 2 or not all(k in req for k in ("argv", "env", "cwd", "log")):
                raise ValueError("a request carries argv, env, cwd, log and two descriptors")
            start, end = _arg_area()
            _command_line(req["argv"], end - start)
            pid = _fork_zygote(req, fds)
        except Exception as e:  # (the client starts its zygote by Popen instead)
            conn.send(f"failed {type(e).__name__}: {e}".encode())
            return []
        finally:
            for fd in fds:
                os.close(fd)
        conn.send(str(pid).encode())
        return [pid]


def start(path: Path, timeout_s: float = 300.0, preload: tuple = PRELOAD, env=None):
    """Start a server on ``path`` (its directory made 0700 if new); returns its ``Popen`` once it
    is ready. It leaves when the ``Popen``'s stdin is closed (or its owner exits)."""
    import subprocess
    path = Path(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "deadpool.launch.zygote_server", "--socket",
                             str(path), "--preload", ",".join(preload), "--pad=" + "." * PAD],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            env=dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"),
                            start_new_session=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready or proc.stdout.readline().strip() != b"ready":
        proc.kill()
        raise RuntimeError(f"the zygote server did not start ({proc.wait()})")
    return proc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--socket", required=True, help="the socket's path (its directory mode 0700)")
    ap.add_argument("--preload", default=",".join(PRELOAD),
                    help="modules imported once, before any fork, comma-separated")
    ap.add_argument("--pad", default="", help="room for the zygotes' command lines (set by start)")
    args = ap.parse_args(argv)
    if len(args.pad) < PAD:
        print(f"zygote_server: --pad must hold {PAD} characters (room for the zygotes' command "
              "lines); start() sets it", file=sys.stderr)
        return 2
    return serve(Path(args.socket), tuple(filter(None, args.preload.split(","))))


if __name__ == "__main__":
    sys.exit(main())
