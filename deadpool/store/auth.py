"""Control-plane authentication: one secret per job keeps strangers out of the coordinator's store.

The coordinator's ``TCPStore`` carries every control message of a job (plans, aborts, fences,
heartbeats, join announcements). A ``TCPStore`` has no authentication of its own, so this module
adds three layers, all derived from one per-job secret:

1. **Binding.** ``serve_store`` binds the master store to one interface address only (loopback
   for the local launcher, the cluster-internal interface on SLURM), never to every interface.
2. **Namespace.** Every key of the job lives under ``namespace(secret)``, a prefix derived from
   the secret (``open_store`` / ``namespaced`` apply it), so a process without the secret that
   uses ordinary key names (another job, a stale worker) never meets the job's keys. It is not a
   secret from a client that reaches the port: torch 2.13's ``Store.list_keys()`` lists every
   key, and the cleartext TCP traffic shows them too.
3. **Seals.** Hence every control message the coordinator or a rank acts on must be written with
   ``seal`` and read with ``unseal`` (HMAC-SHA256 under a key derived from the secret): a forged
   or altered message is refused with ``AuthError``. Pass the store key as ``context`` so that a
   sealed message cannot be replayed under another key (a fence for slot 3 copied to slot 5, a
   generation's report copied into the next one: keys carry the generation). Seals give
   integrity, not secrecy, and cannot stop a connected client from deleting or overwriting keys
   (a denial of service: a deleted report reads as a silent rank) or bumping ``add`` counters.

Sealed (``protocol.Seal``; a value that fails its seal is ignored, logged once per kind): plans,
aborts, fences, join announcements; every process's heartbeat and the coordinator's
(``hb/<slot>``, ``coord/hb``: their counts must increase, so a replayed older beat is no news);
``crash/``, ``fault/``, ``g*/status/``, ``g*/error/``, ``g*/bad_source/``, ``g*/timing/``,
``g*/first_step/``, ``g*/protected/``, ``final/``; the flags ``job/done`` and ``job/stop``;
an agent's ``job/stop_request`` (its signal: ``deadpool.launch.stop``);
``job/step`` and ``job/progress``. The ``add`` counters the coordinator waits on
(``num_finished``, ``num_checkpointed``, ``num_errors``, ``num_protected``) are only wake-up
hints: each rank also writes a sealed per-rank key (``finished/<rank>``, ``checkpointed/<rank>``,
``error/<rank>``, ``protected/<rank>``) and only those count, so a bumped counter steers nothing.

Under node agents the files on a node (``agent.node.plan_file``, ``report_file``) are sealed
too, bound to their names, in a directory only the job's user can enter (``agent.shm``): a
planted plan or report is refused, never acted on or sent on. The ranks' agreements (the protected snapshot step, the snapshot interval:
``deadpool.store.rounds``) never touch an unsealed key: ranks write them on their node's board, agents
carry them in their sealed records, and the results come back as sealed events.

NOT sealed yet (partial): the same agreements without agents, the store counters
``repl_done/<step>`` (a forged bump makes ranks believe a step protected early and drop older
snapshots and replicas: it can cost a recovery its in-memory copies, never make it take a wrong
state, since every transfer is checked against the checksum its sender took) and the snapshot
interval votes (a forged vote changes how often ranks snapshot); ``fault_fired/`` (fault
injection, a testing aid), and the group rendezvous keys gloo writes itself. (The disk-checkpoint
interval is agreed over the job's own process groups, not the store: ``grad_norm.global_max``.)

Contracts: the secret must reach processes only through ``SECRET_ENV`` or a file named by
``SECRET_FILE_ENV`` that only its owner can read; it must never be written to job.json, a log or
an error message. Every process of a job must use the same secret. The local launcher makes one
with ``new_secret()`` per job; on SLURM the sbatch script writes the file (experiments/slurm/).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
import stat
from datetime import timedelta

import torch.distributed as dist

SECRET_ENV = "DEADPOOL_JOB_SECRET"
SECRET_FILE_ENV = "DEADPOOL_JOB_SECRET_FILE"
MIN_SECRET_LEN = 32
_SEAL_VERSION = "s1"


class AuthError(RuntimeError):
    """A secret that cannot be loaded, or a control message that fails authentication."""


def new_secret() -> str:
    """A fresh per-job secret: 64 hex characters (256 bits)."""
    return secrets.token_hex(32)


def load_secret(environ=os.environ) -> str:
    """The secret from ``$DEADPOOL_JOB_SECRET``, else from the file ``$DEADPOOL_JOB_SECRET_FILE``.

    The file must be owned by this user and not be readable or writable by group or others (like
    ssh with private keys). The secret itself never appears in an error message.
    """
    value = environ.get(SECRET_ENV, "").strip()
    source = f"${SECRET_ENV}"
    if not value:
        path = environ.get(SECRET_FILE_ENV, "").strip()
        if not path:
            raise AuthError(
                f"no job secret: set {SECRET_FILE_ENV} to a file only you can read (chmod 600) "
                f"holding the secret, e.g. `(umask 077; python -c 'from deadpool.store.auth import "
                f"new_secret; print(new_secret())' > RUN_DIR/job.secret)`, or set {SECRET_ENV}")
        source = f"{path} (from ${SECRET_FILE_ENV})"
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise AuthError(f"cannot open the job secret file {source}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise AuthError(f"job secret file {source} is not a regular file")
            if st.st_uid != os.getuid():
                raise AuthError(f"job secret file {source} is owned by uid {st.st_uid}, not by "
                                f"this user (uid {os.getuid()}); refusing it")
            if st.st_mode & 0o077:
                raise AuthError(
                    f"permissions {stat.S_IMODE(st.st_mode):04o} for the job secret file {source} "
                    f"are too open: it must not be accessible by group or others. "
                    f"Run `chmod 600 {path}` (or create it under `umask 077`).")
            with os.fdopen(fd, "r", encoding="utf-8") as f:
                fd = -1
                value = f.read().strip()
        finally:
            if fd >= 0:
                os.close(fd)
    if len(value) < MIN_SECRET_LEN:
        raise AuthError(f"the job secret in {source} is empty or shorter than {MIN_SECRET_LEN} "
                        f"characters; generate one with deadpool.store.auth.new_secret()")
    return value


@functools.lru_cache(maxsize=16)  # a heartbeat is sealed 20 times a second: derive the key once
def _derive(secret: str, label: bytes) -> bytes:
    return hmac.new(secret.encode("utf-8"), label, hashlib.sha256).digest()


def namespace(secret: str) -> str:
    """The job's key prefix, ``job-<16 hex>``, for ``dist.PrefixStore`` (which adds the "/").

    It cannot be guessed without the secret, but ``list_keys()`` reveals it: not a credential."""
    return "job-" + _derive(secret, b"namespace").hex()[:16]


def _tag(secret: str, text: str, context: str) -> str:
    ctx = context.encode("utf-8")
    msg = len(ctx).to_bytes(4, "big") + ctx + text.encode("utf-8")
    return hmac.digest(_derive(secret, b"seal"), msg, "sha256").hex()  # (one-shot: C, no object)


def seal(secret: str, text: str, *, context: str = "") -> str:
    """``text`` with an HMAC-SHA256 tag: ``s1:<64 hex>:<text>``. ``context`` (the store key) is
    authenticated too but not stored; ``unseal`` must be given the same one."""
    return f"{_SEAL_VERSION}:{_tag(secret, text, context)}:{text}"


def unseal(secret: str, sealed: str | bytes, *, context: str = "") -> str:
    """The text of a sealed message; raises ``AuthError`` if the tag is missing, bad, or was made
    for another secret or context."""
    if isinstance(sealed, (bytes, bytearray)):
        try:
            sealed = bytes(sealed).decode("utf-8")
        except UnicodeDecodeError:
            raise AuthError("sealed message is not UTF-8") from None
    parts = sealed.split(":", 2)
    if len(parts) != 3 or parts[0] != _SEAL_VERSION:
        raise AuthError("control message is not sealed (missing authentication tag)")
    _, tag, text = parts
    expected = _tag(secret, text, context).encode()
    if not hmac.compare_digest(tag.encode("utf-8", "replace"), expected):
        raise AuthError("control message failed authentication (forged, altered, or another job's)")
    return text


def serve_store(host: str, port: int, timeout_s: float = 60) -> dist.TCPStore:
    """The master ``TCPStore``, listening on ``host``'s address only; ``port=0`` picks a free port
    (read it back as ``store.port``).

    ``TCPStore(is_master=True)`` on its own ignores ``host`` for listening and binds the wildcard
    address (``[::]``, every interface). So the listening socket is bound here and handed over
    with ``master_listen_fd``; in torch 2.13 this works with the libuv backend (``use_libuv=True``)
    and the store takes ownership of the fd (it closes it when the store is destroyed), hence
    ``detach``. A wildcard ``host`` (0.0.0.0, ::, "") is refused: name one interface.
    """
    family, _, _, _, addr = (socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0]
                             if host else (None, None, None, None, ("::",)))
    if ipaddress.ip_address(addr[0].split("%")[0]).is_unspecified:
        raise ValueError(f"store host {host!r} is a wildcard address; name the one interface the "
                         f"store must listen on (127.0.0.1 locally, the cluster-internal address "
                         f"on SLURM)")
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
        bound_port = sock.getsockname()[1]
    except BaseException:
        sock.close()
        raise
    # From here the fd belongs to the store. If the constructor fails, the fd is not closed here:
    # whether the store already closed it is unknown, and a double close could hit a reused fd.
    fd = sock.detach()
    return dist.TCPStore(host, bound_port, is_master=True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False, master_listen_fd=fd, use_libuv=True)


def namespaced(store: dist.Store, secret: str) -> dist.PrefixStore:
    """``store`` seen through the job's namespace (keeps ``store`` alive)."""
    return dist.PrefixStore(namespace(secret), store)


def open_store(host: str, port: int, secret: str, timeout_s: float = 60.0,
               is_master: bool = False) -> dist.PrefixStore:
    """A connection to the job's store, inside the job's namespace. ``is_master=True`` serves the
    store instead (``serve_store``: bound to ``host`` only)."""
    if is_master:
        store = serve_store(host, port, timeout_s)
    else:
        store = dist.TCPStore(host, int(port), is_master=False,
                              timeout=timedelta(seconds=timeout_s), use_libuv=True)
    return namespaced(store, secret)
