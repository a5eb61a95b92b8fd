"""Disk checkpoints with torch.distributed.checkpoint (DCP).

Used for the cases in-memory replicas cannot cover: periodic persistence (``ft.persist_interval_
steps``, written off the training thread by ``AsyncPersister``), the final checkpoint when a rank
dies and no spare is left, and ``ft.resume_from``.

Layout: ``<root>/step_<S>/rank_<r>/`` holds one DCP checkpoint per rank (each rank writes its own
state with ``no_dist=True``, no collectives, so TP/PP shards need no change) plus ``header.json``;
``<root>/step_<S>/meta.json`` names the world size. A step counts only when every rank named by
meta.json has its ``header.json`` (``is_complete``).

Writes are atomic. A rank directory is written under a temporary name in the same step directory
(``.rank_<r>.tmp-<pid>-<id>``), ``header.json`` last, and renamed into place, so ``rank_<r>``
either does not exist or is complete. Two writers of the same (step, rank) - after a coordinator
loss a rank and the buddy holding its replica may both save it - never mix files: the first rename
wins and the second writer discards its copy. ``meta.json`` is replaced atomically, so several
ranks may write it for the same step.

The header is a JSON-serialisable dict (``{"step", "data_position", "generation", "rng_cpu"}``,
``rng_cpu`` being ``encode_rng_state(torch.get_rng_state())``; other JSON-able keys are kept as
given). Nothing arbitrary is unpickled on load: DCP's ``.metadata`` pickle is read with an
unpickler that admits only DCP's metadata classes, tensor data and the older format's ``rng.pt``
go through ``torch.load(..., weights_only=True)``, and the RNG state of an older checkpoint is
returned in the same base64 form.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import pickle
import re
import shutil
import time
import uuid
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType, AsyncSaveResponse

from deadpool.snapshot import lower_thread_priority

HEADER_FILE = "header.json"  # written last: its presence marks a rank's checkpoint complete
META_FILE = "meta.json"
OLD_RNG_FILE = "rng.pt"      # older format only; read, never written
_STEP_DIR = re.compile(r"step_(\d+)")

# dcp.save(no_dist=True) warns on every call that it assumes a single process: that is the intent.
warnings.filterwarnings("ignore", category=UserWarning,
                        message="torch.distributed is disabled, unavailable or uninitialized")


class CheckpointWriteError(RuntimeError):
    """A disk checkpoint write failed (raised on the caller's thread, naming step and directory)."""


def _root_cause(exc: BaseException) -> BaseException:
    """DCP wraps a rank's failure in CheckpointException (a BaseException, even with no_dist);
    unwrap it to the error that happened (e.g. the OSError of a full disk)."""
    if isinstance(exc, CheckpointException) and exc.failures:
        inner = next(iter(exc.failures.values()))
        inner = inner[0] if isinstance(inner, tuple) else inner
        if isinstance(inner, BaseException):
            return inner
    return exc


def _write_error(what: str, exc: BaseException) -> CheckpointWriteError:
    cause = _root_cause(exc)
    err = CheckpointWriteError(f"{what}: {type(cause).__name__}: {cause}")
    err.__cause__ = cause
    return err


# -- header -------------------------------------------------------------------------------------
def encode_rng_state(state: torch.Tensor) -> str:
    """``torch.get_rng_state()`` (a uint8 tensor) -> base64 text, for the JSON header."""
    raw = state.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return base64.b64encode(raw).decode("ascii")


def decode_rng_state(text: str) -> torch.Tensor:
    """Inverse of ``encode_rng_state``: a uint8 tensor for ``torch.set_rng_state``."""
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def _header_text(header: dict) -> str:
    try:
        return json.dumps(header)
    except (TypeError, ValueError) as e:
        bad = []
        for k, v in header.items():
            try:
                json.dumps(v)
            except (TypeError, ValueError):
                bad.append(k)
        raise TypeError(f"checkpoint header must be JSON-serialisable; not: {bad or e} "
                        "(store the RNG state as encode_rng_state(torch.get_rng_state()))") from e


# -- atomic file system steps -------------------------------------------------------------------
def rank_dir(root: str | os.PathLike, step: int, rank: int) -> Path:
    return Path(root) / f"step_{step}" / f"rank_{rank}"


def read_header(step_dir: Path, rank: int) -> dict:
    """The JSON header of ``rank``'s state in a step directory (FileNotFoundError if absent)."""
    return json.loads((Path(step_dir) / f"rank_{rank}" / HEADER_FILE).read_text())


def rank_complete(step_dir: Path, rank: int) -> bool:
    return (Path(step_dir) / f"rank_{rank}" / HEADER_FILE).exists()


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_file_atomic(path: Path, text: str) -> None:
    """Write ``path`` via a temporary file in the same directory and ``os.replace``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _tmp_rank_dir(final: Path) -> Path:
    # same parent as the final name, so the rename stays within one file system; hidden and not
    # named rank_<r>, so is_complete / load never see it
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _install_rank_dir(tmp: Path, final: Path, header_text: str) -> bool:
    """Finish a rank directory written under ``tmp``: ``header.json`` last, then rename it to
    ``final``. Returns False if a complete ``final`` already existed (``tmp`` is discarded)."""
    with open(tmp / HEADER_FILE, "w") as f:
        f.write(header_text)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    for _ in range(16):
        try:
            # POSIX rename of a directory onto an existing non-empty one fails (ENOTEMPTY/EEXIST)
            # instead of replacing it, so the first of two writers wins and files never mix
            os.rename(tmp, final)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            if (final / HEADER_FILE).exists():  # another writer's complete copy: keep it
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            # an incomplete leftover (a crash in the older, in-place format): move it aside. If a
            # second writer installs its copy in between, that copy is moved aside instead and
            # ours replaces it - both hold the same step's state, so either is right.
            stale = final.with_name(f".{final.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:12]}")
            try:
                os.rename(final, stale)
            except FileNotFoundError:
                continue
            shutil.rmtree(stale, ignore_errors=True)
            continue
        _fsync_dir(final.parent)
        return True
    raise CheckpointWriteError(f"could not rename {tmp} into place as {final}")


# -- synchronous save / meta / discovery / load -------------------------------------------------
def save_rank_state(root, step: int, rank: int, state: dict[str, torch.Tensor], header: dict) -> Path:
    """Write one rank's state (name -> tensor, as from ``StateLayout.state_dict``) at ``step``,
    atomically; a no-op if a complete copy is already there. Returns the rank directory. Raises
    ``TypeError`` for a header that is not JSON, ``CheckpointWriteError`` if the write fails."""
    text = _header_text(header)
    final = rank_dir(root, step, rank)
    if (final / HEADER_FILE).exists():
        return final
    tmp = _tmp_rank_dir(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        _install_rank_dir(tmp, final, text)
    except (Exception, CheckpointException) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, CheckpointWriteError):
            raise
        err = _write_error(f"checkpoint of step {step} (rank {rank}) to {final} failed", e)
        raise err from err.__cause__
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def write_meta(root, step: int, world_size: int, reason: str, layout: dict | None = None) -> None:
    """Write ``step_<S>/meta.json`` atomically (any number of ranks may write it for one step).
    ``layout``: the parallel degrees it was written at (``{"dp", "tp", "pp"}``), for a load at
    another data-parallel width (``reshard_rank_state``)."""
    p = Path(root) / f"step_{step}"
    p.mkdir(parents=True, exist_ok=True)
    meta = {"step": step, "world_size": world_size, "reason": reason}
    if layout is not None:
        meta["layout"] = layout
    _write_file_atomic(p / META_FILE, json.dumps(meta))


def read_meta(step_dir) -> dict:
    return json.loads((Path(step_dir) / META_FILE).read_text())


def is_complete(step_dir: Path) -> bool:
    """Every rank named by meta.json finished writing (its header.json is written last)."""
    step_dir = Path(step_dir)
    try:
        meta = json.loads((step_dir / META_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    n = meta.get("world_size") if isinstance(meta, dict) else None
    return isinstance(n, int) and n > 0 and all(
        (step_dir / f"rank_{r}" / HEADER_FILE).exists() for r in range(n))


def _complete_steps(root: Path) -> list[tuple[int, Path]]:
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for p in entries:
        m = _STEP_DIR.fullmatch(p.name)
        if m and is_complete(p):
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_complete_step(root) -> int | None:
    """The newest step under ``root`` whose checkpoint is complete, or None if there is none."""
    steps = _complete_steps(Path(root))
    return steps[-1][0] if steps else None


def latest_step_dir(root) -> Path:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one)."""
    root = Path(root)
    if (root / META_FILE).exists():
        if not is_complete(root):
            raise FileNotFoundError(f"checkpoint {root} is incomplete (a rank's state is missing)")
        return root
    steps = _complete_steps(root)
    if not steps:
        raise FileNotFoundError(f"no complete DeadPool checkpoint (step_*/meta.json + every rank) under {root}")
    return steps[-1][1]


class _DcpMetadataUnpickler(pickle.Unpickler):
    """DCP's FileSystemReader reads ``.metadata`` with plain ``pickle.load``, so a crafted
    checkpoint could run code on load. A DCP metadata pickle only ever names these classes."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": {
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "TensorProperties",
            "ChunkStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch": {"Size"},
        "torch.serialization": {"_get_layout"},
        "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    }

    def find_class(self, module: str, name: str):
        if name in self.ALLOWED.get(module, ()) or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"checkpoint metadata names {module}.{name}, which DCP metadata "
                                     "never contains; refusing to load it")


class _SafeFileSystemReader(dcp.FileSystemReader):
    """``dcp.FileSystemReader`` whose metadata is read with ``_DcpMetadataUnpickler`` (tensor data
    is already read with ``torch.load(weights_only=True)`` by DCP)."""

    def read_metadata(self, *args, **kwargs):
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
            metadata = _DcpMetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_rank_state(step_dir: Path, rank: int, state: dict[str, torch.Tensor]) -> dict:
    """Load rank ``rank``'s tensors in place into ``state``; returns the header (JSON dict, with
    ``rng_cpu`` as base64 text whichever format the checkpoint was written in). Nothing is
    unpickled beyond DCP's own metadata classes and tensors."""
    d = Path(step_dir) / f"rank_{rank}"
    if not d.exists():
        raise FileNotFoundError(f"checkpoint {step_dir} has no state for rank {rank}")
    try:
        header = json.loads((d / HEADER_FILE).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint {d} is incomplete (no {HEADER_FILE})") from None
    try:
        dcp.load(state, storage_reader=_SafeFileSystemReader(d), no_dist=True)
    except CheckpointException as e:  # a BaseException: surface the error itself
        cause = _root_cause(e)
        if cause is e:
            raise
        raise cause from e
    old_rng = d / OLD_RNG_FILE
    if "rng_cpu" not in header and old_rng.exists():
        # older format: {"rng_cpu": tensor | None} saved with torch.save; tensors only, no pickle
        old = torch.load(old_rng, weights_only=True)
        rng = old.get("rng_cpu") if isinstance(old, dict) else None
        if rng is not None:
            header["rng_cpu"] = encode_rng_state(rng)
    return header


def read_rank_state(step_dir: Path, rank: int) -> tuple[dict[str, torch.Tensor], dict]:
    """Rank ``rank``'s tensors as written (shapes from DCP's metadata), and its header."""
    d = Path(step_dir) / f"rank_{rank}"
    meta = _SafeFileSystemReader(d).read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in meta.state_dict_metadata.items()}
    return state, load_rank_state(step_dir, rank, state)


# -- asynchronous periodic checkpoints ----------------------------------------------------------
class _NoCopyStager(AsyncStager):
    """Hands the state dict to the upload thread as it is.

    async_save's default stager (DefaultStager -> StateDictStager) copies every tensor into a new
    CPU state dict, synchronously on the calling thread. The state given to ``AsyncPersister`` is
    already a private host copy that nobody writes until the upload is done (it is the persister's
    until then), so that would be a second full copy of the rank's state on the training thread
    for nothing. ``stage`` returns the dict itself (not a Future), and no synchronisation is
    needed afterwards (``_synchronize_after_execute = False``; the deprecated
    ``synchronize_staging`` is then never called). Passing a stager also keeps async_save from
    staging with the storage writer itself: ``dcp.FileSystemWriter`` is a ``BlockingAsyncStager``,
    which copies too."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def close(self) -> None:
        pass


class _RankDirWriter(dcp.FileSystemWriter):
    """DCP's file system writer (one data file, fsync'd, written on the calling thread:
    ``thread_count=1``) into a rank's temporary directory. ``finish`` - the StorageWriter hook DCP
    calls last, once data and ``.metadata`` are on disk - then runs ``on_finish`` (header.json,
    rename, meta.json) on the same upload thread, so the whole write stays off the training
    thread and a failure in any part of it reaches the returned future."""

    def __init__(self, path: Path, on_finish, nice: int):
        super().__init__(path)
        self._on_finish = on_finish
        self._nice = nice

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        # runs first on the upload thread, which async_save creates for this save alone
        lower_thread_priority(self._nice)
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)

    def finish(self, metadata, results) -> None:
        super().finish(metadata, results)
        self._on_finish()


class _Job:
    def __init__(self, step: int, rank: int, final: Path, tmp: Path, future: Future, state):
        self.step, self.rank, self.final, self.tmp = step, rank, final, tmp
        self.future, self.state = future, state


class AsyncPersister:
    """Periodic disk checkpoints of one rank, written off the training thread, one at a time.

    ``submit`` hands over a private host copy of the state (e.g. ``StateLayout.state_dict`` of a
    flat buffer the caller will not touch until ``in_flight`` is False) and returns at once; the
    write goes through ``torch.distributed.checkpoint.async_save`` (thread executor, no process
    group, ``no_dist=True``, no staging copy), then ``header.json`` (completion marker) and the
    rename into ``rank_<r>``, then ``meta.json``. A failed write never raises on the training
    thread by itself: it is kept and raised as ``CheckpointWriteError`` from the next ``submit`` or
    ``wait``. ``rank`` may be (re)assigned before a submit (e.g. once a generation gives it).
    """

    def __init__(self, root, rank: int | None = None, *, reason: str = "periodic", nice: int = 0):
        self.root = Path(root)
        self.rank = rank
        self.reason = reason
        self.nice = int(nice)
        self.last_step_written: int | None = None
        self.skipped = 0                      # submits refused because a write was in flight
        self.last_write_s: float | None = None  # seconds the last successful write took
        self._job: _Job | None = None
        self._error: CheckpointWriteError | None = None
        self._stager = _NoCopyStager()
        self._closed = False

    @property
    def in_flight(self) -> bool:
        """A write is running (its state tensors still belong to the persister)."""
        job = self._job
        return job is not None and not job.future.done()

    def submit(self, step: int, state: dict[str, torch.Tensor], header: dict, world_size: int) -> bool:
        """Start writing ``state`` (ownership passes to the persister until the write is done) as
        this rank's checkpoint of ``step``. Returns False, counting ``skipped``, if the previous
        write is still running; never blocks. Raises ``CheckpointWriteError`` for a previous
        write that failed (this state is then not submitted) and ``TypeError`` for a header that
        is not JSON-serialisable."""
        if self._closed:
            raise RuntimeError("AsyncPersister is closed")
        if self.rank is None:
            raise ValueError("AsyncPersister.rank is not set")
        if self._job is not None:
            if not self._job.future.done():
                self.skipped += 1
                return False
            self._harvest()
        self._raise_pending()
        text = _header_text(header)  # on the caller's thread: a caller bug, not an I/O failure
        rank, root, reason = self.rank, self.root, self.reason
        final = rank_dir(root, step, rank)
        tmp = _tmp_rank_dir(final)
        t0 = time.perf_counter()

        def on_finish() -> None:  # on the upload thread, after the DCP files are on disk
            _install_rank_dir(tmp, final, text)
            write_meta(root, step, world_size, reason)
            self.last_write_s = time.perf_counter() - t0
            self.last_step_written = step

        # async_save in torch 2.13: THREAD runs dcp.save (no_dist=True: no process group, no
        # collectives) on a one-off thread; PROCESS needs an initialised default process group
        # (its daemon is set up with dist.get_rank and a TCPStore) and hands the state to another
        # process, so it is not usable here. On this thread async_save only wraps each top-level
        # entry (DCP's Stateful check + logging, ~25 us a tensor) and starts the upload thread;
        # the step directory and tmp are created by the writer, on the upload thread.
        try:
            res = dcp.async_save(state, storage_writer=_RankDirWriter(tmp, on_finish, self.nice),
                                 async_stager=self._stager, no_dist=True,
                                 async_checkpointer_type=AsyncCheckpointerType.THREAD)
        except (Exception, CheckpointException) as e:
            err = _write_error(f"could not start the checkpoint of step {step} (rank {rank}) "
                               f"to {final}", e)
            raise err from err.__cause__
        fut = res.upload_completion if isinstance(res, AsyncSaveResponse) else res
        self._job = _Job(step, rank, final, tmp, fut, state)
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the in-flight write is done (True) or ``timeout`` seconds passed (False);
        raises ``CheckpointWriteError`` if it - or an earlier unreported write - failed."""
        if self._job is not None:
            try:
                self._job.future.exception(timeout=timeout)
            except FutureTimeout:
                return False
            self._harvest()
        self._raise_pending()
        return True

    def close(self) -> None:
        """Wait for the in-flight write (raising its error, if any) and release resources."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._stager.close()

    def _harvest(self) -> None:
        job, self._job = self._job, None  # drops the state: the caller's buffer is free again
        exc = job.future.exception()
        if exc is None:
            return
        shutil.rmtree(job.tmp, ignore_errors=True)
        self._error = _write_error(f"asynchronous checkpoint of step {job.step} (rank {job.rank}) "
                                   f"to {job.final} failed", exc)

    def _raise_pending(self) -> None:
        err, self._error = self._error, None
        if err is not None:
            raise err
