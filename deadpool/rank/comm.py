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
  repl_out     2-rank group (this rank, its buddy), gloo: snapshot replication sends; with
               ft.replicas=k also repl_out1 .. repl_out{k-1}, one per further buddy
  repl_in      2-rank group (its ward, this rank), gloo: replicas received (repl_in1 ...: one
               per further ward)
A group that would hold only this rank is not made. Pipeline traffic goes over 2-rank groups with
``broadcast`` rather than ``send``/``recv`` because a point-to-point wait cannot be polled (a
timed-out gloo recv breaks the pair), while a collective can; one group per direction keeps each
group's op order identical on both ends, so 1F1B's crossing sends cannot deadlock. Groups are
created in one global order (sorted by key), which makes the rendezvous deadlock-free. State
transfer to a rank being restored uses a 2-rank group per (holder, receiver) pair of the plan,
made at transfer time (``pair_group``).

Survivors must never sit in a collective until its timeout: the abort watcher, the abortable
helper threads and parking are ``deadpool.rank.abort``'s (``Abortable``, which ``Communicator``
extends).

How a collective is waited depends on the backend:

  gloo   ``wait`` blocks the host in short timed slices and checks the flag between them (gloo
         cannot be aborted: an abandoned op stays parked, see above).
  nccl   stream-ordered: ``wait`` makes the compute stream wait for the collective and returns;
         the host queues the step's work ahead and synchronises with the GPU once per step
         (``sync``, where the trainer then reads the loss). An aborted NCCL kernel exits early
         with junk in its buffer and reports itself complete, and an aborted communicator fails
         every later post and wait: so every backend error on a generation that is being aborted
         becomes ``Aborted``, any other one ``CollectiveError`` (reported to the store), and
         ``sync`` raises ``Aborted`` if the abort flag was set before the step's work was seen
         complete: nothing completed after an abort is trusted. A build that is aborted midway
         aborts the groups it already made (each is registered before it connects, so the
         watcher can abort a connect stuck on a dead peer). The NCCL environment this relies on
         is set by ``deadpool.rank.nccl_env``.

Group keys are the same on every backend; on gloo only groups with a replaced member must be
rebuilt, on NCCL every group is (all were aborted).
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from deadpool.errors import Aborted, CollectiveError, CoordinatorLost
from deadpool.rank.abort import MAX_ABANDONED_HELPERS, Abortable, abandoned_helpers
from deadpool.rank.counted import Counted
from deadpool.rank.groups import rank_groups
from deadpool.rank.watchdog import PEER_WAIT
from deadpool.store import reports
from deadpool.store.protocol import Keys, Seal, announce_abort, wake_coordinator
from deadpool.threads import run_in_thread
from deadpool.topology import Topology


BACKENDS = ("auto", "gloo", "nccl")

def resolve_backend(device: str, backend: str = "auto") -> str:
    """The backend of the training groups (dp, tp, pipeline): ``auto`` is nccl on CUDA, gloo on CPU.

    gloo also reduces CUDA tensors (staged through host memory): another way to run several
    ranks on one GPU besides ``launcher.share_gpu``. The replication group is gloo whatever this
    says.
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
    """A process group (not yet connected: see ``_connect``)."""
    pstore = dist.PrefixStore(prefix, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(pstore, rank, size, timedelta(seconds=timeout_s))
    if backend == "nccl":  # pragma: no cover - needs CUDA
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(pstore, rank, size, opts)
    raise ValueError(f"unknown backend {backend!r} (gloo | nccl)")


def _connect(pg) -> None:  # pragma: no cover - needs CUDA
    """NCCL creates its communicator at the first collective: create it now, inside the abortable
    build, and wait for that collective (every peer joined, and with ``NCCL_RUNTIME_CONNECT=0``
    every algorithm connected), so no peer lost before the first step hangs the training thread
    in a connect that no abort frees (measured: experiments/results/gpu)."""
    pg.allreduce([torch.zeros(1, device="cuda")]).wait()
    torch.cuda.current_stream().synchronize()


def _device_event():  # pragma: no cover - needs CUDA (tests substitute a fake)
    return torch.cuda.Event()


def _sync_sleep(waited_s: float) -> float:
    """How long ``sync`` sleeps between polls: short at first (a step's tail is usually short),
    at most 1 ms (the most a step can lose to polling)."""
    return min(1e-3, max(5e-5, waited_s / 50))


class Communicator(Abortable):
    """Process groups of one generation for one rank. Build with ``Communicator.build``."""

    def __init__(self, topo: Topology, store, backend: str, poll_s: float, timeout_s: float,
                 lost: threading.Event | None = None, fault_hook=None, seal: Seal | None = None,
                 abort_probe=None, link=None):
        self.topo = topo
        self.link = link  # the node agent's board (agent.client.NodeLink), or None
        # under a node agent: ``abort_probe(g)`` reads the node's board (no store request); the
        # store's abort key is read only once it says the generation was aborted
        self.abort_probe = abort_probe
        self.store = store
        self.backend = backend
        self.stream_ordered = backend == "nccl"  # see the module docstring
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
        # set once the generation is being aborted (always before any group is aborted)
        self._abort_reason: str | None = None
        self.progress = None  # the training thread's Progress: waits report "collective"
        self._lock = threading.Lock()
        self._parked = threading.Event()
        self._watcher: threading.Thread | None = None
        self._aborting: list[threading.Thread] = []
        self._aborted_groups: set[str] = set()
        self.abort_s: dict[str, float] = {}  # seconds each device group's abort took (measured)
        self.syncs = 0  # host synchronisations (stream-ordered path)
        self._unchecked: list = []  # works waited on the stream since the last sync
        self.kept: list[str] = []  # keys of groups taken over from the previous generation

    @classmethod
    def build(cls, topo: Topology, store, backend: str = "gloo", poll_s: float = 0.02,
              timeout_s: float = 120.0, repl_nice: int = 0, store_factory=None, lost=None,
              fault_hook=None, step: int = 0, seal: Seal | None = None,
              previous: "Communicator | None" = None, keep=(), abort_probe=None,
              link=None) -> "Communicator":
        """Build this rank's groups of ``topo.generation``; abortable (raises ``Aborted``).

        ``previous`` / ``keep``: groups of the previous generation whose keys the plan lists as
        clean (see ``reusable_groups``) are taken over instead of rebuilt.

        ``store_factory`` must return a fresh store client: a rendezvous blocks the client it
        uses, and the main thread keeps polling the abort key on ``store`` meanwhile.
        """
        if abandoned_helpers() >= MAX_ABANDONED_HELPERS:
            raise RuntimeError(f"{abandoned_helpers()} helper threads of earlier generations are "
                               "still stuck (group builds or transfers abandoned on abort): this "
                               "process stops taking ranks, a spare takes its place")
        self = cls(topo, store, backend, poll_s, timeout_s, lost, fault_hook, seal, abort_probe, link)
        gstore = store_factory() if store_factory is not None else store
        self.build_store = gstore  # free again once the build is done (callers may reuse it)
        if backend == "nccl" or abort_probe is None:
            self.start_watcher()  # an abort during the build aborts what it has made so far

        device = torch.cuda.current_device() if backend == "nccl" and torch.cuda.is_available() \
            else None

        def make():
            if device is not None:  # pragma: no cover - needs CUDA
                torch.cuda.set_device(device)  # the helper thread's device is not the caller's
            self.fault_hook(step, "rebuild")
            for name, key, ranks, repl in rank_groups(topo):
                if self._abort_reason is not None:
                    raise Aborted(self._abort_reason)  # abandoned: make nothing more
                old = previous.by_key(key) if previous is not None and key in keep else None
                if old is not None:
                    self.groups[name], self.group_ranks[name], self.group_keys[name] = old
                    self.groups[name].owner(self)  # its errors are this generation's now
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

        try:
            if store_factory is None:
                make()  # tests of the happy path: no helper thread needed
            else:
                self.run_abortable(make, "group rebuild")
        except BaseException:
            self.park()  # a build aborted midway aborts the device groups it made
            raise
        return self

    def _add(self, store, name: str, key: str, ranks: list[int], backend: str | None = None):
        backend = backend or self.backend
        prefix = f"g{self.topo.generation}/{key}/"
        group = Counted(_new_group(backend, store, prefix, ranks.index(self.topo.rank),
                                    len(ranks), self.timeout_s), self)
        # registered before it connects: an abort meanwhile aborts it, which frees the connect
        with self._lock:
            self.groups[name], self.group_ranks[name], self.group_keys[name] = group, ranks, key
            late = self._abort_reason is not None and self._on_device(name)
            if late:
                self._aborted_groups.add(name)
        if late:  # made after the abort sweep: abort it here
            self._abort_one(name, group.pg)
            raise Aborted(self._abort_reason)
        if backend == "nccl":  # pragma: no cover - needs CUDA
            _connect(group.pg)

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

    def failed(self, what: str, err: BaseException) -> Exception:
        """The exception to raise for a backend error (posting, waiting, completing): ``Aborted``
        while the generation is being aborted (an aborted NCCL communicator fails every op),
        otherwise a ``CollectiveError``, reported to the store so every rank stops waiting."""
        if isinstance(err, (Aborted, CollectiveError, CoordinatorLost)):
            return err
        try:
            if self._read_abort_key(probe=False):
                return Aborted(self._abort_reason)
        except Exception:  # the store is unreachable: the heartbeat decides what that means
            pass
        msg = f"{what} failed: {err}"
        self.report_error(msg)
        return CollectiveError(msg)

    def wait(self, work) -> None:
        """Wait for ``work``; raise ``Aborted`` if the generation is aborted meanwhile.

        Must be used for every collective on the critical path. On NCCL the compute stream waits
        (see the module docstring); on gloo the host waits in polled slices. A local error (peer
        gone, or the group's own timeout) is reported to the store so that ranks not connected
        to the dead one stop waiting at once; the whole wait is bounded by ``timeout_s``.
        """
        if self.stream_ordered:
            try:
                work.wait()
            except RuntimeError as e:  # DistBackendError included
                raise self.failed("collective", e) from None
            self._unchecked.append(work)  # its outcome is known only once the device ran it
            return
        with self._waiting():
            self._wait(work)

    def _waiting(self):
        """Report the training thread as waiting on peers while it blocks."""
        if self.progress is not None and self.progress.phase not in PEER_WAIT:
            return self.progress.waiting()
        return nullcontext()

    def _wait(self, work) -> None:
        t0 = time.monotonic()
        while True:
            try:
                work.wait(self.poll)
                return
            except RuntimeError:
                if work.is_completed():  # finished meanwhile, or failed: ask it again
                    try:
                        work.wait()
                        return
                    except RuntimeError as e:
                        raise self.failed("collective", e) from None
            self.raise_if_aborted()
            if time.monotonic() - t0 > self.timeout_s:
                msg = f"collective did not complete within {self.timeout_s:.0f} s"
                self.report_error(msg)
                raise CollectiveError(msg)

    def sync(self) -> None:
        """Stream-ordered (NCCL): the training thread's one host synchronisation per step. Waits
        until the device has run everything queued so far, polling the local abort flag (no
        store request); raises ``Aborted`` if the generation was aborted before that work was
        seen complete, since an aborted kernel also completes, with junk; then asks every
        collective waited since the last sync for its outcome (a failed one raises). A no-op on
        gloo, whose waits already blocked the host."""
        if not self.stream_ordered:
            return
        self.syncs += 1
        done = _device_event()
        done.record()
        t0 = time.monotonic()
        with self._waiting():
            while not done.query():
                if self.aborted():
                    break
                if time.monotonic() - t0 > self.timeout_s:
                    msg = f"the device did not finish the step within {self.timeout_s:.0f} s"
                    self.report_error(msg)
                    raise CollectiveError(msg)
                time.sleep(_sync_sleep(time.monotonic() - t0))
        self.raise_if_aborted()
        works, self._unchecked = self._unchecked, []
        for work in works:  # all done: each wait returns at once, or raises the op's error
            try:
                work.wait()
            except RuntimeError as e:
                raise self.failed("collective", e) from None

    def report_error(self, msg: str) -> None:
        reports.post(self.store, self.seal, self.keys.error(self.topo.rank), msg[:500])  # first
        self.store.add(self.keys.num_errors, 1)
        wake_coordinator(self.store)
        # Waking every survivor now is cheaper than waiting for the coordinator to confirm.
        announce_abort(self.store, self.seal, self.keys,
                       f"collective error on rank {self.topo.rank}: {msg[:200]}")

    def allreduce_mean(self, flat: torch.Tensor, group: str = "dp", on_posted=None) -> None:
        self.allreduce(flat, group, on_posted=on_posted)
        flat.div_(len(self.group_ranks[group]))

    def allreduce(self, t: torch.Tensor, group: str, op=dist.ReduceOp.SUM, on_posted=None,
                  wait: bool = True):
        """In-place all-reduce over ``group``, abortable; ``wait=False``: posted only, the work
        returned (``wait`` for it before reading ``t``)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        work = self.groups[group].allreduce([t], opts)
        if on_posted is not None:
            on_posted()
        if not wait:
            return work
        self.wait(work)

    def broadcast_async(self, t: torch.Tensor, group: str, src: int):
        """Post a broadcast of ``t`` from global rank ``src`` over ``group``; returns the work
        (wait for it with ``wait``). On a 2-rank group this is an abortable send/receive."""
        opts = dist.BroadcastOptions()
        opts.rootRank = self.group_ranks[group].index(src)
        opts.rootTensor = 0
        return self.groups[group].broadcast([t], opts)

    def release(self, keep=()) -> threading.Thread | None:
        """Once the next generation is built: let go of this parked generation's groups whose
        keys are not in ``keep`` (the ones the next generation took over). A gloo group's TCP
        event loop can spin on a dead peer's socket for as long as the group lives (measured
        after a SIGKILL: epoll_wait returning the same EPOLLIN at once, 40-60 % of a core on a
        survivor, the whole next generation slower); an aborted NCCL group holds device memory
        and threads. Deleting a gloo group with an op in flight blocks until the op ends, so the
        last references are dropped on a daemon thread (after the NCCL aborts are done), or by
        the abandoned thread that still holds the group."""
        names = [n for n, k in self.group_keys.items() if k not in keep and n in self.groups]
        drop = [self.groups.pop(n) for n in names]
        if not drop:
            return None
        aborting = list(self._aborting)

        def let_go():
            for t in aborting:
                t.join(self.timeout_s)
            drop.clear()

        t = threading.Thread(target=let_go, name=f"release-g{self.topo.generation}", daemon=True)
        t.start()
        return t
