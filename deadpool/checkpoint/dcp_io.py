"""One rank's state to and from a DCP checkpoint directory, with nothing arbitrary unpickled.

Each rank writes its own state with ``dcp.save(no_dist=True)`` (no collectives, so TP/PP shards
need no change). On load DCP's ``.metadata`` pickle is read with an unpickler that admits only
DCP's metadata classes; tensor data and the older format's ``rng.pt`` go through
``torch.load(..., weights_only=True)``, and the RNG state of an older checkpoint is returned in the
same base64 form as a current one.
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta

from deadpool.checkpoint.files import (HEADER_FILE, OLD_RNG_FILE, WRITTEN_AT, CheckpointWriteError,
                                       _header_text, _root_cause, _same_layout, _tmp_rank_dir,
                                       _write_error, complete_layout, encode_rng_state, holds,
                                       install_rank, is_whole, layout_tag, rank_dir)

# dcp.save(no_dist=True) warns on every call that it assumes a single process: that is the intent.
warnings.filterwarnings("ignore", category=UserWarning,
                        message="torch.distributed is disabled, unavailable or uninitialized")


def save_rank_state(root, step: int, rank: int, state: dict[str, torch.Tensor], header: dict,
                    *, layout: dict | None = None, world_size: int | None = None) -> Path:
    """Write one rank's state (name -> tensor, as from ``StateLayout.state_dict``) at ``step``,
    atomically, as written at ``layout`` and ``world_size`` (recorded in its header); a no-op if
    a complete copy of this layout is already there (a whole one, if this write is whole:
    ``files.holds``), or the step is complete at another layout (``files``: one layout per
    step). Returns the rank directory. Raises ``TypeError`` for a header that is not JSON,
    ``CheckpointWriteError`` if the write fails."""
    tag = None if world_size is None else layout_tag(world_size, layout)
    text = _header_text(header if tag is None else dict(header, **{WRITTEN_AT: tag}))
    final = rank_dir(root, step, rank)
    if (final / HEADER_FILE).exists():
        try:
            if holds(final, tag, is_whole(header)):
                return final
        except (FileNotFoundError, json.JSONDecodeError):
            pass
    other = complete_layout(final.parent)
    if other is not None and not _same_layout(other, tag):
        return final  # the step's checkpoint stands at its own layout
    tmp = _tmp_rank_dir(final)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        install_rank(tmp, final, text, tag)
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
    header.pop(WRITTEN_AT, None)  # the checkpoint's own bookkeeping, not the rank's header
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
