"""The communicator: the one object that owns every process group of one generation.

A generation's groups are created in a fresh store namespace (``g{generation}/...``) so a rebuilt
group never meets keys left by a broken one. When a failure is declared the whole object is parked
(kept referenced, never used again: gloo groups with an op in flight block on delete, and buffers of
abandoned ops may still be written) and the next generation builds a new one; once it is built,
the parked generation's gloo groups it did not take over are released off the main thread.

Groups (this rank's; every one is small: no group spans all ranks, so nothing on the recovery
path grows with the job):
  dp           this rank's data-parallel group (gradient all-reduce / ZeRO reduce-scatter and
               all-gather)
  tp           its tensor-parallel group (all-reduces inside forward and backward)
  pp_send_fwd  2-rank group (this stage, next stage): activations this rank sends
  pp_recv_fwd  2-rank group (previous stage, this stage): activations it receives
  pp_send_bwd  2-rank group (this stage, previous stage): input gradients it sends back
  pp_recv_bwd  2-rank group (next stage, this stage): output gradients it receives
  repl_out     2-rank group (this rank, its buddy), gloo: snapshot replication sends
  repl_in      2-rank group (its ward, this rank), gloo: replicas received
A group that would hold only this rank is not made. Pipeline traffic goes over 2-rank groups with
``broadcast`` rather than ``send``/``recv`` because a point-to-point wait cannot be polled (a
timed-out gloo recv breaks the pair), while a collective can; one group per direction keeps each
group's op order identical on both ends, so 1F1B's crossing sends cannot deadlock. Groups are
created in one global order (sorted by key), which makes the rendezvous deadlock-free. State
transfer to a rank being restored uses a 2-rank group per (holder, receiver) pair of the plan,
made at transfer time (``pair_group``).

On NCCL (never run on more than one GPU here; its logic is unit-tested on CPU with fake groups):
a timed ``work.wait`` that expires aborts the communicator, so ``wait`` polls
``work.is_completed()`` instead; and a collective whose peer died never completes while its
kernel holds the stream, so a watcher thread (``start_watcher``) aborts every NCCL group of the
generation as soon as the abort key is set, which frees the stream and any thread blocked in NCCL.
Group keys are the same on every backend, so only groups with a replaced member must be rebuilt.

Survivors must never sit in a collective until its timeout: ``wait`` polls the generation's abort
key between short waits and raises ``Aborted`` once it is set. What cannot be polled (a group's
rendezvous, point-to-point state transfer) runs in a helper thread through ``run_abortable``; the
main thread polls the abort key and abandons the helper on abort. Every wait is bounded by
elapsed time (``timeout_s``), never by parsing error text.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from deadpool.auth import AuthError
from deadpool.errors import Aborted, CollectiveError, CoordinatorLost, PassThrough
from deadpool.protocol import Keys, Seal, announce_abort
from deadpool.threads import run_in_thread
from deadpool.groups import rank_groups
from deadpool.topology import Topology
from deadpool.watchdog import PEER_WAIT


BACKENDS = ("auto", "gloo", "nccl")


def resolve_backend(device: str, backend: str = "auto") -> str:
    """The backend of the training groups (dp, tp, pipeline): ``auto`` is nccl on CUDA, gloo on CPU.

    gloo also reduces CUDA tensors (staged through host memory): use it to run several ranks on
    one GPU, which NCCL refuses. The replication group is gloo whatever this says.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {list(BACKENDS)}, got {backend!r}")
    cuda = device.startswith("cuda")
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ValueError("backend=nccl needs device=cuda")
    return backend


def _new_group(backend: str, store, prefix: str, rank: int, size: int, timeout_s: float):
    pstore = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(pstore, rank, size, timedelta(seconds=timeout_s))
    if backend == "nccl":  # pragma: no cover - needs CUDA
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        pg = dist.ProcessGroupNCCL(pstore, rank, size, opts)
        # NCCL connects lazily, at the first collective: a peer lost between the rebuild and
        # that collective would hang the training thread where no abort frees it (measured:
        # experiments/results/gpu). Connect now, inside the abortable build.
        pg.allreduce([torch.zeros(1, device="cuda")]).wait()
        return pg
    raise ValueError(f"unknown backend {backend!r} (gloo | nccl)")


class Communicator:
    """Process groups of one generation for one rank. Build with ``Communicator.build``."""

    def __init__(self, topo: Topology, store, backend: str, poll_s: float, timeout_s: float,
                 lost: threading.Event | None = None, fault_hook=None, seal: Seal | None = None):
        self.topo = topo
        self.store = store
        self.backend = backend
        self.poll_s = poll_s
        self.poll = timedelta(seconds=poll_s)
        self.timeout_s = timeout_s
        self.keys = Keys(topo.generation)
        self.groups: dict[str, object] = {}
        self.group_ranks: dict[str, list[int]] = {}
        self.group_keys: dict[str, str] = {}
        self.lost = lost or threading.Event()
        self.fault_hook = fault_hook or (lambda step, phase: None)
        self.seal = seal or Seal(None)
        self._abort_reason: str | None = None
        self.progress = None  # the training thread's Progress: waits report "collective"
        self._parked = threading.Event()
        self._aborted_groups: set[str] = set()
        self.kept: list[str] = []  # keys of groups taken over from the previous generation

    @classmethod
    def build(cls, topo: Topology, store, backend: str = "gloo", poll_s: float = 0.02,
              timeout_s: float = 120.0, repl_nice: int = 0, store_factory=None, lost=None,
              fault_hook=None, step: int = 0, seal: Seal | None = None,
              previous: "Communicator | None" = None, keep=()) -> "Communicator":
        """Build this rank's groups of ``topo.generation``; abortable (raises ``Aborted``).

        ``previous`` / ``keep``: groups of the previous generation whose keys the plan lists as
        clean (see ``reusable_groups``) are taken over instead of rebuilt.

        ``store_factory`` must return a fresh store client: a rendezvous blocks the client it
        uses, and the main thread keeps polling the abort key on ``store`` meanwhile.
        """
        self = cls(topo, store, backend, poll_s, timeout_s, lost, fault_hook, seal)
        gstore = store_factory() if store_factory is not None else store
        self.build_store = gstore  # free again once the build is done (callers may reuse it)

        device = torch.cuda.current_device() if backend == "nccl" else None

        def make():
            if device is not None:  # pragma: no cover - needs CUDA
                torch.cuda.set_device(device)  # the helper thread's device is not the caller's
            self.fault_hook(step, "rebuild")
            for name, key, ranks, repl in rank_groups(topo):
                old = previous.by_key(key) if previous is not None and key in keep else None
                if old is not None:
                    self.groups[name], self.group_ranks[name], self.group_keys[name] = old
                    self.kept.append(key)
                elif repl:
                    # The replication channel always runs on gloo over host memory (pinned
                    # buffers on CUDA). It is created from a lower-priority thread so gloo's
                    # I/O threads for it inherit that priority: replication traffic then yields
                    # the CPU to training.
                    run_in_thread(lambda: self._add(gstore, name, key, ranks, backend="gloo"),
                                  repl_nice, name="repl-group-init")
                else:
                    self._add(gstore, name, key, ranks)

        if store_factory is None:
            make()  # tests of the happy path: no helper thread needed
        else:
            self.run_abortable(make, "group rebuild")
        if backend == "nccl":  # pragma: no cover - needs CUDA
            self.start_watcher()
        return self

    def start_watcher(self) -> threading.Thread:
        """NCCL: abort the generation's device groups as soon as its abort key is set."""
        def watch():
            while not self._parked.is_set():
                try:
                    if self.aborted():
                        break
                except CoordinatorLost:
                    break
                except Exception:  # a store hiccup: the heartbeat thread decides what it means
                    pass
                self._parked.wait(self.poll_s)
            self.abort_device_groups()

        t = threading.Thread(target=watch, name=f"nccl-abort-watcher-g{self.topo.generation}",
                             daemon=True)
        t.start()
        return t

    def abort_device_groups(self) -> None:
        """Abort every group on the device backend (gloo host groups are left parked)."""
        if self.backend != "nccl":
            return
        for name, pg in list(self.groups.items()):
            if not name.startswith(("repl", "xfer")) and name not in self._aborted_groups:
                self._aborted_groups.add(name)
                try:
                    pg.abort()
                except Exception:
                    pass

    def _add(self, store, name: str, key: str, ranks: list[int], backend: str | None = None):
        prefix = f"g{self.topo.generation}/{key}/"
        self.groups[name] = _Counted(_new_group(backend or self.backend, store, prefix,
                                                ranks.index(self.topo.rank), len(ranks),
                                                self.timeout_s))
        self.group_ranks[name] = ranks
        self.group_keys[name] = key

    def pair_group(self, store, a: int, b: int):
        """A 2-rank gloo group (``a`` sends to ``b``) for one state transfer; both ends call this
        (inside ``run_abortable``) with the same pair."""
        name = f"xfer/{a}-{b}"
        if name not in self.groups:
            self._add(store, name, name, [a, b], backend="gloo")
        return self.groups[name]

    def has(self, name: str) -> bool:
        return name in self.groups

    def by_key(self, key: str):
        for name, k in self.group_keys.items():
            if k == key:
                return self.groups[name], self.group_ranks[name], k
        return None

    def group_counts(self) -> dict[str, list[int]]:
        """``key -> [ops posted, ops completed]`` of the groups a later generation may keep
        (training groups; never replication or transfer groups, whose threads are abandoned)."""
        return {self.group_keys[n]: [g.posted, g.completed] for n, g in self.groups.items()
                if not n.startswith(("repl", "xfer"))}

    def group(self, name: str):
        return self.groups[name]

    def group_rank(self, name: str, rank: int) -> int:
        return self.group_ranks[name].index(rank)

    # -- failure-aware waiting -------------------------------------------------------------------
    def aborted(self) -> bool:
        """True once the generation's abort key holds a message sealed by this job."""
        if self._abort_reason is not None:
            return True
        if self.lost.is_set():
            raise CoordinatorLost("the coordinator stopped answering")
        if not self.store.check([self.keys.abort]):
            return False
        try:
            self._abort_reason = self.seal.unwrap(self.keys.abort, self.store.get(self.keys.abort))
        except AuthError:
            return False  # not written by this job: ignored
        return True

    def raise_if_aborted(self) -> None:
        if self.aborted():
            raise Aborted(self._abort_reason)

    def wait(self, work) -> None:
        """Wait for ``work``; raise ``Aborted`` if the generation is aborted meanwhile.

        Must be used for every collective on the critical path. A local error (peer gone, or the
        group's own timeout) is reported to the store so that ranks not connected to the dead one
        stop waiting at once. A poll slice and a real failure are told apart by the work's state
        (a failed work is completed), and the whole wait is bounded by ``timeout_s``.
        """
        if self.progress is not None and self.progress.phase not in PEER_WAIT:
            with self.progress.waiting():
                return self._wait(work)
        return self._wait(work)

    def _wait(self, work) -> None:
        t0 = time.monotonic()
        while True:
            if self.backend == "nccl":
                # a timed-out wait on NCCL aborts the communicator: poll completion instead
                if work.is_completed():
                    work.wait()
                    return
                time.sleep(min(self.poll_s, 0.0005))
            else:
                try:
                    work.wait(self.poll)
                    return
                except RuntimeError:
                    if work.is_completed():  # finished meanwhile, or failed: ask it again
                        try:
                            work.wait()
                            return
                        except RuntimeError as e:
                            self.report_error(str(e))
                            raise CollectiveError(str(e)) from None
            self.raise_if_aborted()
            if time.monotonic() - t0 > self.timeout_s:
                msg = f"collective did not complete within {self.timeout_s:.0f} s"
                self.report_error(msg)
                raise CollectiveError(msg)

    def run_abortable(self, fn, what: str):
        """Run ``fn()`` in a helper thread and return its result, polling the abort key.

        Raises ``Aborted`` if the generation is aborted first (the helper is abandoned: it may
        finish or fail later, and whatever it writes must be dropped by the caller),
        ``CollectiveError`` if ``fn`` raises or runs past ``timeout_s``. Other exceptions that
        must pass through (e.g. a corrupt transfer) are re-raised unchanged if they subclass
        ``PassThrough``.
        """
        box: dict = {}
        done = threading.Event()

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the caller
                box["error"] = e
            done.set()

        threading.Thread(target=run, name=f"{what}-g{self.topo.generation}", daemon=True).start()
        t0 = time.monotonic()
        while not done.wait(self.poll_s):
            self.raise_if_aborted()
            if time.monotonic() - t0 > self.timeout_s:
                msg = f"{what} did not finish within {self.timeout_s:.0f} s"
                self.report_error(msg)
                raise CollectiveError(msg)
        err = box.get("error")
        if err is not None:
            if isinstance(err, PassThrough):
                raise err
            self.report_error(f"{what} failed: {err}")
            raise CollectiveError(f"{what} failed: {err}") from err
        return box.get("value")

    def report_error(self, msg: str) -> None:
        self.store.set(self.keys.error(self.topo.rank), msg[:500])
        self.store.add(self.keys.num_errors, 1)
        # Waking every survivor now is cheaper than waiting for the coordinator to confirm.
        announce_abort(self.store, self.seal, self.keys,
                       f"collective error on rank {self.topo.rank}: {msg[:200]}")

    def allreduce_mean(self, flat: torch.Tensor, group: str = "dp", on_posted=None) -> None:
        self.allreduce(flat, group, on_posted=on_posted)
        flat.div_(len(self.group_ranks[group]))

    def allreduce(self, t: torch.Tensor, group: str, op=dist.ReduceOp.SUM, on_posted=None) -> None:
        """In-place all-reduce over ``group``, abortable."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        work = self.groups[group].allreduce([t], opts)
        if on_posted is not None:
            on_posted()
        self.wait(work)

    def broadcast_async(self, t: torch.Tensor, group: str, src: int):
        """Post a broadcast of ``t`` from global rank ``src`` over ``group``; returns the work
        (wait for it with ``wait``). On a 2-rank group this is an abortable send/receive."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self.group_ranks[group].index(src)
        opts.rootTensor = 0
        return self.groups[group].broadcast([t], opts)

    def park(self) -> None:
        """Called when the generation is over. The caller must keep the parked object referenced
        (the worker does: ``Worker.parked``): its groups may have ops in flight (see module doc)
        until the next generation is built and ``release`` lets go of the gloo ones."""
        self._parked.set()
        self.abort_device_groups()

    def release(self, keep=()) -> threading.Thread | None:
        """Let go of this parked generation's gloo groups whose keys are not in ``keep`` (the
        ones the next generation took over). A gloo group's TCP event loop can spin on a dead
        peer's socket for as long as the group lives (measured after a SIGKILL: epoll_wait
        returning the same EPOLLIN at once, 40-60 % of a core on a survivor, the whole next
        generation slower). Deleting a group with an op in flight blocks until the op ends, so
        the last references are dropped on a daemon thread, or by the abandoned thread that
        still holds the group. NCCL groups were aborted at ``park`` and stay referenced."""
        names = [n for n, k in self.group_keys.items() if k not in keep and n in self.groups
                 and isinstance(getattr(self.groups[n], "pg", None), dist.ProcessGroupGloo)]
        drop = [self.groups.pop(n) for n in names]
        if not drop:
            return None
        t = threading.Thread(target=drop.clear, name=f"release-g{self.topo.generation}", daemon=True)
        t.start()
        return t


class _Counted:
    """A process group that counts the ops posted on it and the ones seen complete, so that a
    recovery can tell a group all members left cleanly (reusable) from one left mid-op."""

    _POSTING = frozenset({"allreduce", "broadcast", "reduce_scatter", "allgather", "send", "recv",
                          "_reduce_scatter_base", "_allgather_base", "reduce_scatter_tensor_coalesced",
                          "allgather_into_tensor_coalesced", "allreduce_coalesced", "barrier",
                          "reduce", "gather", "scatter", "alltoall", "alltoall_base"})

    def __init__(self, pg):
        self.pg = pg
        self.posted = self.completed = 0

    def __getattr__(self, name):
        attr = getattr(self.pg, name)
        if name not in self._POSTING:
            return attr

        def post(*args, **kwargs):
            work = attr(*args, **kwargs)
            self.posted += 1
            return _CountedWork(work, self)
        return post


class _CountedWork:
    def __init__(self, work, group: _Counted):
        self.work, self.group, self.done = work, group, False

    def wait(self, *args):
        out = self.work.wait(*args)
        if not self.done:
            self.done = True
            self.group.completed += 1
        return out

    def __getattr__(self, name):
        return getattr(self.work, name)
