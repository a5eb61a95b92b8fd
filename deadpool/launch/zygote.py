"""One pre-imported interpreter that forks a job's node agents: ``python -m deadpool.launch.zygote``.

With ``launcher.fork_agents`` the local ``launcher.AgentLauncher`` starts this process once per
job instead of one new interpreter per node agent: it imports what an agent needs (the agent's
main and, for ``launcher.fork_workers``, the worker) once, then forks one agent per request
(``procs.fork_main``: the argv, environment, log file and new session that ``subprocess.Popen``
would give it). Each agent's start then costs a fork, not an interpreter start and a torch import
(~2 s of CPU each on a 2-core machine).

The agents are this process's children, not the launcher's, so this process reaps them and
reports each exit. It stays single-threaded (``fork_main`` refuses to fork a process that runs a
second thread): one ``select`` over its stdin and a ``signal.set_wakeup_fd`` pipe that SIGCHLD
writes to. The protocol, one line each way::

    launcher -> zygote (stdin)    {"id": 3, "module": "deadpool.agent.__main__", "argv": [...],
                                   "env": {...}, "log": "<run_dir>/logs/agent1.log", "name": ...}
    zygote -> launcher (stdout)   ready
                                  started 3 <pid>        | failed 3 <why>
                                  exit <pid> <code>      (a signal's exit is -signum)

It never outlives the job: it exits when the last agent it forked has exited (the job's agents
are gone: a later request finds it gone, and the launcher starts that agent by ``Popen``), and at
the end of its stdin (the launcher closed it, or died and the kernel closed it) it takes no more
requests and exits once every agent it forked has (they leave by themselves as agents started by
``Popen`` would: the job's end, a fence, or the coordinator's loss). So a stopped (SIGSTOP)
coordinator does not keep it: its agents' exits end it.

``ZygoteClient`` is the launcher's side: it starts this process, asks it for agents and hands
back, per agent, a ``ZygoteChild`` with the part of ``subprocess.Popen`` the launcher uses
(``pid``, ``poll``, ``wait``, ``returncode``), fed by one reader thread. Only the local launcher
uses it: agents that srun or ``ip netns exec`` start (experiments/testbed) are new interpreters.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from deadpool.launch.procs import fork_main

PRELOAD = ("deadpool.agent.__main__", "deadpool.rank.worker")  # an agent and, forked, its ranks


def _child_setup() -> None:
    """In a forked agent, before its main: what ``Popen(start_new_session=True)`` gives a child
    and the zygote's own plumbing must not leak into it (the wake-up descriptor, stdin)."""
    signal.set_wakeup_fd(-1)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    if devnull:
        os.close(devnull)


def wait_ready(watch: list, wake: int, timeout_s: float = 1.0) -> list:
    """Those of ``watch`` ready to read within ``timeout_s``, or none once a signal wrote to the
    wake-up descriptor ``wake`` (``signal.set_wakeup_fd``; drained here)."""
    try:
        ready, _, _ = select.select([*watch, wake], [], [], timeout_s)
    except InterruptedError:
        return []
    if wake in ready:
        try:
            os.read(wake, 4096)
        except BlockingIOError:
            pass
    return [x for x in ready if x != wake]


class Zygote:
    """The forking loop; ``out`` is the report descriptor (stdout)."""

    def __init__(self, out: int = 1, inp: int = 0):
        self.out, self.inp = out, inp
        self.children: set[int] = set()
        self.buf, self.open, self.forked = b"", True, False

    def say(self, line: str) -> None:
        try:
            os.write(self.out, (line + "\n").encode())
        except OSError:  # the launcher is gone: its children still get reaped
            pass

    def run(self) -> int:
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        signal.signal(signal.SIGCHLD, lambda *a: None)  # (a handler: the wake-up fd needs one)
        signal.set_wakeup_fd(w)
        self.say("ready")
        while self.children or (self.open and not self.forked):
            ready = wait_ready([self.inp] if self.open else [], r)
            if self.open and self.inp in ready:
                self.read_requests()
            self.reap()
        return 0

    def read_requests(self) -> None:
        data = os.read(self.inp, 1 << 16)
        if not data:
            self.open = False
            return
        self.buf += data
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            if line.strip():
                self.spawn(json.loads(line))

    def spawn(self, req: dict) -> None:
        try:
            module = importlib.import_module(req["module"])
            child = fork_main(module.main, list(req["argv"]), req["log"], dict(req["env"]),
                              preexec_fn=_child_setup, module=module,
                              name=req.get("name", ""))
        except Exception as e:  # (the launcher starts that one by Popen instead)
            self.say(f"failed {req.get('id')} {type(e).__name__}: {e}".replace("\n", " "))
            return
        self.children.add(child.pid)
        self.forked = True
        self.say(f"started {req['id']} {child.pid}")

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                self.children.clear()
                return
            if not pid:
                return
            self.children.discard(pid)
            self.say(f"exit {pid} {os.waitstatus_to_exitcode(status)}")


class ZygoteChild:
    """An agent forked by the zygote, as the launcher sees it: ``returncode`` is set when the
    zygote reports its exit (``-signum`` for a signal); a kill is ``os.kill(pid, ...)``."""

    def __init__(self, pid: int, client: "ZygoteClient"):
        self.pid, self.returncode, self._client = pid, None, client

    def poll(self) -> int | None:
        if self.returncode is None and self._client.lost:  # the zygote died: none can report
            try:  # (an agent it forked leaves by itself; until then it is alive)
                os.kill(self.pid, 0)
            except ProcessLookupError:
                self.returncode = -signal.SIGKILL
            except PermissionError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._client.cond:
            while self.poll() is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
                self._client.cond.wait(0.2 if left is None else min(0.2, left))
        return self.returncode


class ServedZygote:
    """A zygote forked by a zygote server (``zygote_server.py``), with the part of ``subprocess.Popen`` ``ZygoteClient`` uses
    (``pid``, ``stdin``, ``stdout``, ``kill``, ``wait``). Not this process's child: its exit is
    the end of its stdout (it alone holds the write end)."""

    def __init__(self, server: str, argv: list[str], env: dict, log: Path, timeout_s: float = 30.0):
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
                s.settimeout(timeout_s)
                s.connect(server)
                req = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log)}
                socket.send_fds(s, [json.dumps(req).encode()], [in_r, out_w])
                answer = s.recv(4096).decode()
        except BaseException:
            for fd in (in_w, out_r):
                os.close(fd)
            raise
        finally:
            os.close(in_r)
            os.close(out_w)
        if not answer.isdigit():
            os.close(in_w)
            os.close(out_r)
            raise RuntimeError(f"the zygote server could not fork: {answer or 'no answer'}")
        self.pid, self.returncode = int(answer), None
        self.stdin, self.stdout = os.fdopen(in_w, "wb"), os.fdopen(out_r, "rb")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                with open(f"/proc/{self.pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] in "ZX":
                        self.returncode = 0  # (its status is its server's to read)
            except OSError:
                self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout)
            time.sleep(0.02)
        return self.returncode


class ZygoteClient:
    """The launcher's side of one zygote (``python -m deadpool.launch.zygote``).

    ``start`` returns once the zygote has imported what an agent needs, or raises (the launcher
    then starts its agents by ``Popen``); ``spawn`` asks for one forked agent. ``close`` ends the
    zygote's stdin and waits for it: it exits once its agents have. The zygote must be closed
    only after the launcher has waited for its agents."""

    def __init__(self, job_json: Path, env: dict, log: Path, ready_timeout_s: float = 300.0,
                 preload: tuple = PRELOAD, server: str | None = None):
        self.cond = threading.Condition()
        self.children: dict[int, ZygoteChild] = {}
        self.exits: dict[int, int] = {}  # reported before the start line was read
        self.answers: dict[int, str] = {}
        self.lost, self.ready, self.next_id = False, False, 0
        argv = [sys.executable, "-m", "deadpool.launch.zygote", "--job", str(job_json),
                # (the default unnamed: a search for agents or ranks by command line must not
                # find the zygote)
                *(["--preload", ",".join(preload)] if preload != PRELOAD else [])]
        self.proc = None
        if server:  # launcher.zygote_server: a fork of a pre-imported interpreter
            try:
                self.proc = ServedZygote(server, argv, env, log)
            except (OSError, RuntimeError) as e:
                print(f"[deadpool] launcher.zygote_server {server}: {e}; starting the zygote "
                      "as a new interpreter", flush=True)
        if self.proc is None:
            with open(log, "a") as err:
                self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=err, env=env, start_new_session=True)
        self.reader = threading.Thread(target=self._read, daemon=True, name="zygote-reader")
        self.reader.start()
        with self.cond:
            if not self.cond.wait_for(lambda: self.ready or self.lost, ready_timeout_s):
                self.close(kill=True)
                raise TimeoutError(f"the zygote was not ready within {ready_timeout_s} s")
        if not self.ready:
            raise RuntimeError(f"the zygote exited ({self.proc.wait()}) before it was ready")

    def _read(self) -> None:
        for raw in self.proc.stdout:
            word, *rest = raw.decode(errors="replace").split(" ", 2)
            with self.cond:
                if word.strip() == "ready":
                    self.ready = True
                elif word == "exit":
                    pid, code = int(rest[0]), int(rest[1])
                    if pid in self.children:
                        self.children[pid].returncode = code
                    else:
                        self.exits[pid] = code
                elif word in ("started", "failed"):
                    self.answers[int(rest[0])] = raw.decode(errors="replace").strip()
                self.cond.notify_all()
        with self.cond:
            self.lost = True
            self.cond.notify_all()

    def spawn(self, module: str, argv: list[str], env: dict, log: Path, name: str = "",
              timeout_s: float = 60.0) -> ZygoteChild:
        """Fork one process running ``module.main(argv)`` (``fork_main``'s contract)."""
        with self.cond:
            if self.lost:
                raise RuntimeError("the zygote is gone")
            rid, self.next_id = self.next_id, self.next_id + 1
            req = {"id": rid, "module": module, "argv": [str(a) for a in argv], "env": env,
                   "log": str(log), "name": name}
            try:
                self.proc.stdin.write((json.dumps(req) + "\n").encode())
                self.proc.stdin.flush()
            except OSError as e:  # (it left with its last agent, or died)
                raise RuntimeError(f"the zygote is gone ({e})") from e
            if not self.cond.wait_for(lambda: rid in self.answers or self.lost, timeout_s):
                raise TimeoutError(f"the zygote did not fork within {timeout_s} s")
            answer = self.answers.pop(rid, "lost")
            if not answer.startswith("started"):
                raise RuntimeError(f"the zygote could not fork: {answer}")
            child = ZygoteChild(int(answer.split()[2]), self)
            self.children[child.pid] = child
            child.returncode = self.exits.pop(child.pid, None)
            return child

    def close(self, timeout_s: float = 30.0, kill: bool = False) -> None:
        """End the zygote's stdin; it exits once its agents have (SIGKILLed after ``timeout_s``,
        or at once with ``kill``)."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if kill:
            self.proc.kill()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.reader.join(5.0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", help="the job file (named so that the job's processes are found by "
                                  "command line: launcher.job_processes)")
    ap.add_argument("--preload", default=",".join(PRELOAD),
                    help="modules imported before the first fork, comma-separated")
    args = ap.parse_args(argv)
    for name in filter(None, args.preload.split(",")):
        importlib.import_module(name)
    return Zygote().run()


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # (a forked agent inherits this stdout object)
    code = main()
    os._exit(code)
