"""The on-disk layout of DeadPool checkpoints and its atomic file-system steps.

Layout: ``<root>/step_<S>/rank_<r>/`` holds one DCP checkpoint per rank plus ``header.json``;
``<root>/step_<S>/meta.json`` names the world size (and the parallel layout it was written at). A
step counts only when every rank named by meta.json has its ``header.json`` (``is_complete``).

Writes are atomic. A rank directory is written under a temporary name in the same step directory
(``.rank_<r>.tmp-<pid>-<id>``), ``header.json`` last, and renamed into place, so ``rank_<r>``
either does not exist or is complete. Two writers of the same (step, rank) never mix files: the
first rename wins and the second writer discards its copy. ``meta.json`` is replaced atomically,
so several ranks may write it for the same step.

One step directory holds one parallel layout. A job that changes its data-parallel width (an
elastic shrink or regrow) may write a step twice, at two layouts; each rank's header records the
layout it was written at (``written_at``: world size and degrees), and:

    step complete at layout A, written at B   nothing changes (the same step's state: a load at
                                              B re-cuts A's shards); meta.json keeps saying A
    step incomplete at A, written at B        B's rank directories replace A's, meta.json says B
                                              and A's leftovers are removed
    meta.json at B over shards of A           never complete (``is_complete`` checks every
                                              rank's layout against meta.json)

The header is a JSON-serialisable dict (``{"step", "data_position", "generation", "rng_cpu"}``,
``rng_cpu`` being ``encode_rng_state(torch.get_rng_state())``).

A rank directory may hold its whole state or only part of it (``checkpoint.unique``: its header
names where the rest is, ``shared_from`` or ``shared_parts``). A whole copy replaces one of the
same layout that takes its shared tensors from another rank's directory (``shared_from``), never
the reverse: a periodic checkpoint begun at a step (parameters in data-parallel rank 0's
directory only) may be finished by a stop that writes whole states, rank 0's by the holder of
its replica, which lacks the parameters; the other ranks' copies, kept, would leave them nowhere.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
from torch.distributed.checkpoint.api import CheckpointException

HEADER_FILE = "header.json"  # written last: its presence marks a rank's checkpoint complete
META_FILE = "meta.json"
WRITTEN_AT = "written_at"    # header key: the layout (world size, degrees) a rank was written at
SHARED_FROM = "shared_from"  # header key: ranks whose directories hold this rank's shared tensors
SHARED_PARTS = "shared_parts"  # header key: this rank holds parts of its shared tensors only
OLD_RNG_FILE = "rng.pt"      # older format only; read, never written
_STEP_DIR = re.compile(r"step_(\d+)")


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


@contextlib.contextmanager
def atomic_open(path: Path, mode: str = "w", opener=open):
    """A file whose contents appear under ``path`` only once written whole: written to a
    temporary name in the same directory, fsynced, then ``os.replace``d; a failed write leaves
    nothing under ``path`` and no temporary behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:12]}.tmp")
    try:
        with opener(tmp, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write_file_atomic(path: Path, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)
    _fsync_dir(path.parent)


def _tmp_rank_dir(final: Path) -> Path:
    # same parent as the final name, so the rename stays within one file system; hidden and not
    # named rank_<r>, so is_complete / load never see it
    return final.with_name(f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")


# -- layouts ------------------------------------------------------------------------------------
def layout_tag(world_size: int, layout: dict | None = None) -> dict:
    """What a rank directory and meta.json record of the layout a step was written at."""
    tag = {"world_size": int(world_size)}
    if layout:
        tag.update({k: int(layout[k]) for k in ("dp", "tp", "pp") if k in layout})
    return tag


def _same_layout(a: dict | None, b: dict | None) -> bool:
    """Two tags name the same layout (an untagged side, the older format, matches anything)."""
    if a is None or b is None:
        return True
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def _meta_tag(meta: dict) -> dict:
    return layout_tag(meta["world_size"], meta.get("layout"))


def _rank_tag(rank_path: Path) -> dict | None:
    """The layout a complete rank directory was written at (None: older format, untagged);
    FileNotFoundError if it is not complete."""
    header = json.loads((rank_path / HEADER_FILE).read_text())
    return header.get(WRITTEN_AT) if isinstance(header, dict) else None


def is_whole(header: dict) -> bool:
    """A rank's header says its directory holds all of its state (``checkpoint.unique``)."""
    return not header.get(SHARED_FROM) and not header.get(SHARED_PARTS)


def holds(rank_path: Path, tag: dict | None, whole: bool) -> bool:
    """The complete rank directory ``rank_path`` holds what a write at layout ``tag`` would: the
    same layout and, if the write is ``whole``, not a copy that names another rank's directory
    for its shared tensors (``shared_from``; see the module docstring). A copy with spread parts
    (``shared_parts``) holds: its group reads their parts from it. False for another layout or a
    copy to replace; ``FileNotFoundError`` (or a JSON error) if it is not complete."""
    header = json.loads((rank_path / HEADER_FILE).read_text())
    if not isinstance(header, dict):
        return True  # (older format, untagged: matches anything)
    return _same_layout(header.get(WRITTEN_AT), tag) and not (whole and header.get(SHARED_FROM))


def complete_layout(step_dir: Path) -> dict | None:
    """The layout tag of a complete step directory (from its meta.json), else None."""
    try:
        meta = json.loads((Path(step_dir) / META_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return _meta_tag(meta) if is_complete(step_dir) else None


def _move_aside_and_remove(path: Path) -> None:
    stale = path.with_name(f".{path.name}.stale-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, stale)
    except FileNotFoundError:
        return
    shutil.rmtree(stale, ignore_errors=True)


def install_rank(tmp: Path, final: Path, header_text: str, tag: dict | None) -> bool:
    """Install a rank directory written under ``tmp`` at layout ``tag``, unless its step is
    complete at another layout (that checkpoint stands; ``tmp`` is discarded). Returns whether
    ``tmp`` became ``final``."""
    other = complete_layout(final.parent)
    if other is not None and not _same_layout(other, tag):
        shutil.rmtree(tmp, ignore_errors=True)
        return False
    return _install_rank_dir(tmp, final, header_text, tag)


def _install_rank_dir(tmp: Path, final: Path, header_text: str, tag: dict | None = None) -> bool:
    """Finish a rank directory written under ``tmp``: ``header.json`` last, then rename it to
    ``final``. Returns False if a complete ``final`` that ``holds`` this one already existed
    (``tmp`` is discarded); one of another layout, or a partial one where this is whole, is
    replaced."""
    header = json.loads(header_text)
    whole = not isinstance(header, dict) or is_whole(header)
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
            try:
                same = holds(final, tag, whole)
            except (FileNotFoundError, json.JSONDecodeError):
                same = None  # incomplete (or gone meanwhile)
            if same:  # another writer's complete copy of this layout: keep it
                shutil.rmtree(tmp, ignore_errors=True)
                return False
            if same is False:  # another layout's leftover (never mixed with this one), or a
                _move_aside_and_remove(final)  # partial copy where this one is whole
                continue
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


def write_meta(root, step: int, world_size: int, reason: str, layout: dict | None = None) -> bool:
    """Write ``step_<S>/meta.json`` atomically (any number of ranks may write it for one step).
    ``layout``: the parallel degrees it was written at (``{"dp", "tp", "pp"}``), for a load at
    another data-parallel width (``reshard_rank_state``). A step already complete at another
    layout is left as it is (returns False); otherwise rank directories of another layout (a
    write of that layout that never completed) are removed: the step holds one layout only."""
    p = Path(root) / f"step_{step}"
    tag = layout_tag(world_size, layout)
    other = complete_layout(p)
    if other is not None and not _same_layout(other, tag):
        return False
    p.mkdir(parents=True, exist_ok=True)
    meta = {"step": step, "world_size": world_size, "reason": reason}
    if layout is not None:
        meta["layout"] = layout
    _write_file_atomic(p / META_FILE, json.dumps(meta))
    for d in p.iterdir():
        m = re.fullmatch(r"rank_(\d+)", d.name)
        if m is None:
            continue
        try:
            stale = int(m.group(1)) >= world_size or not _same_layout(_rank_tag(d), tag)
        except (FileNotFoundError, json.JSONDecodeError):
            stale = int(m.group(1)) >= world_size
        if stale:
            _move_aside_and_remove(d)
    return True


def read_meta(step_dir) -> dict:
    return json.loads((Path(step_dir) / META_FILE).read_text())


def is_complete(step_dir: Path) -> bool:
    """Every rank named by meta.json finished writing (its header.json is written last), at the
    layout meta.json names."""
    step_dir = Path(step_dir)
    try:
        meta = json.loads((step_dir / META_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    n = meta.get("world_size") if isinstance(meta, dict) else None
    if not (isinstance(n, int) and n > 0):
        return False
    tag = _meta_tag(meta)
    for r in range(n):
        try:
            if not _same_layout(_rank_tag(step_dir / f"rank_{r}"), tag):
                return False
        except (OSError, json.JSONDecodeError):
            return False
    return True


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


def resolve_resume(resume_from, checkpoint_dir) -> str | None:
    """``ft.resume_from`` as a job starts it: ``auto`` is ``checkpoint_dir`` when a complete
    checkpoint is under it (a job stopped, preempted or requeued in the same run directory
    resumes from the newest), else None (start from step 0); any other value as given."""
    if resume_from != "auto":
        return resume_from
    return str(checkpoint_dir) if latest_complete_step(checkpoint_dir) is not None else None


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
