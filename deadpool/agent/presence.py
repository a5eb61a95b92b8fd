"""Presence: one TCP connection per remote node agent, whose end is news at once.

Under srun the coordinator holds no process of a node, so it learnt of a node's death only from
its silent record (``ft.node_timeout_s``, or the survivors' broken collectives and a culprit
wait): 1.5-3 s. But when a node's processes die and its host lives on (the agent killed, an
out-of-memory kill, a crashed driver taking the processes down), the host's kernel closes their
sockets: a connection the agent holds to the coordinator ends with a FIN or a reset within a
round trip. So each agent keeps one:

    coordinator  PresenceServer   listens on the store's address; per connection: a nonce out,
                                  the agent's node sealed with it back (no process without the
                                  job's secret can speak for a node); then it only watches
                                  for the end of the stream: ``on_gone(node)``
    agent        PresenceClient   connects, answers, holds the socket; a thread reads it, and
                                  the stream's end (EOF, reset) means the coordinator's process
                                  is gone: ``coordinator_gone``

Neither side sends anything after the hello, so a connection costs nothing in steady state. A
partition or a host that lost power ends nothing (no packet arrives): the silent record still
covers those, and an agent tells them apart from a dead coordinator by this stream
(``agent.__main__``: a cut-off node fences itself, a node whose coordinator died saves its state).
"""

from __future__ import annotations

import secrets
import selectors
import socket
import threading
import time

from deadpool.store import auth

HELLO_MAX = 256  # bytes: a sealed node number
HELLO_TIMEOUT_S = 10.0
PROBE_S = 0.5  # ``cut_off``'s wait for an answer from the coordinator's host


def _context(nonce: str) -> str:
    return f"presence/{nonce}"


class PresenceServer(threading.Thread):
    """Coordinator side (see the module docstring). ``on_gone(node)`` runs on this thread, once
    per connection that said which node it is and then ended."""

    def __init__(self, host: str, secret: str, on_gone, on_forged=None):
        super().__init__(name="presence", daemon=True)
        self.secret, self.on_gone = secret, on_gone
        self.on_forged = on_forged or (lambda: None)
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        self._listen = socket.socket(family, socket.SOCK_STREAM)
        self._listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listen.bind((host, 0))
        self._listen.listen(socket.SOMAXCONN)
        self._listen.setblocking(False)
        self.port = self._listen.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._halt = threading.Event()
        self.nodes: dict[int, int] = {}  # node -> its connections open now
        self.forgeries = 0  # hellos without the job's secret

    def run(self) -> None:
        while not self._halt.is_set():
            for key, _ in self._sel.select(timeout=0.5):
                if key.data is None:
                    self._accept()
                else:
                    self._read(key.fileobj, key.data)
            late = time.monotonic() - HELLO_TIMEOUT_S  # a connection that never says who it is
            for key in list(self._sel.get_map().values()):  # holds no descriptor for long
                if key.data is not None and key.data["node"] is None and key.data["t"] < late:
                    self._drop(key.fileobj)
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()

    def _accept(self) -> None:
        try:
            conn, _ = self._listen.accept()
        except OSError:
            return
        nonce = secrets.token_hex(16)
        try:
            conn.setblocking(True)
            conn.settimeout(1.0)
            conn.sendall(nonce.encode() + b"\n")
            conn.setblocking(False)
        except OSError:
            conn.close()
            return
        self._sel.register(conn, selectors.EVENT_READ,
                           {"nonce": nonce, "buf": b"", "node": None, "t": time.monotonic()})

    def _read(self, conn: socket.socket, state: dict) -> None:
        try:
            data = conn.recv(HELLO_MAX)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # a reset: the same news as an orderly end
        if state["node"] is None:
            if data:
                state["buf"] += data
                if b"\n" not in state["buf"]:
                    if len(state["buf"]) > HELLO_MAX:
                        self._drop(conn)
                    return
                try:
                    text = auth.unseal(self.secret, state["buf"].split(b"\n", 1)[0],
                                       context=_context(state["nonce"]))
                    state["node"] = int(text)
                    self.nodes[state["node"]] = self.nodes.get(state["node"], 0) + 1
                except (auth.AuthError, ValueError):
                    self.forgeries += 1
                    if self.forgeries == 1:  # said once
                        self.on_forged()
                    self._drop(conn)
                return
            self._drop(conn)  # ended before saying who it is: nobody's news
            return
        if data:
            return  # nothing is expected after the hello; ignore it
        node = state["node"]
        self._drop(conn)
        self.nodes[node] -= 1
        self.on_gone(node)

    def _drop(self, conn: socket.socket) -> None:
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=2.0)
        else:
            self._listen.close()


class PresenceClient(threading.Thread):
    """Agent side (see the module docstring): ``connect()`` says hello as ``node``;
    ``coordinator_gone`` is set once the stream ends (the coordinator's process is gone).
    ``close()`` ends it from this side (the agent leaving)."""

    def __init__(self, host: str, port: int, node: int, secret: str):
        super().__init__(name="presence", daemon=True)
        self.host, self.port, self.node, self.secret = host, int(port), node, secret
        self.coordinator_gone = threading.Event()
        self.sock: socket.socket | None = None
        self._closing = False

    def connect(self, timeout_s: float = HELLO_TIMEOUT_S) -> "PresenceClient":
        sock = socket.create_connection((self.host, self.port), timeout=timeout_s)
        try:
            nonce = b""
            while not nonce.endswith(b"\n"):
                part = sock.recv(64)
                if not part or len(nonce) > 64:
                    raise ConnectionError("the coordinator closed the presence connection")
                nonce += part
            hello = auth.seal(self.secret, str(self.node), context=_context(nonce.strip().decode()))
            sock.sendall(hello.encode() + b"\n")
            sock.settimeout(None)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.start()
        return self

    def run(self) -> None:
        while True:
            try:
                data = self.sock.recv(64)
            except OSError:
                data = b""
            if not data:
                if not self._closing:
                    self.coordinator_gone.set()
                return

    def cut_off(self, timeout_s: float = PROBE_S) -> bool:
        """This host cannot reach the coordinator's: the stream has not ended (its process
        would have closed it in dying) and a fresh connection gets no answer at all. A refused
        one means its host answers and the process is gone; an accepted one, that it is there
        (a process that is stopped still has its kernel complete the handshake)."""
        if self.coordinator_gone.is_set():
            return False
        try:
            socket.create_connection((self.host, self.port), timeout=timeout_s).close()
            return False
        except ConnectionRefusedError:
            return False
        except OSError:  # timed out, or no route: cut off
            return True

    def close(self) -> None:
        self._closing = True
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
