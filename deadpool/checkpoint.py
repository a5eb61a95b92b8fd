"""Disk checkpoints with torch.distributed.checkpoint (DCP).

Used for the cases in-memory replicas cannot cover: periodic persistence (``ft.persist_interval_
steps``), the final checkpoint when a rank dies and no spare is left, and ``ft.resume_from``.
Layout: ``<dir>/step_<S>/rank_<r>/`` holds one DCP checkpoint per rank (each rank writes its own
state, so TP/PP shards need no change), plus ``<dir>/step_<S>/meta.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


def rank_dir(root: str | os.PathLike, step: int, rank: int) -> Path:
    return Path(root) / f"step_{step}" / f"rank_{rank}"


def save_rank_state(root, step: int, rank: int, state: dict[str, torch.Tensor], header: dict) -> Path:
    """Write one rank's state (name -> tensor, as from ``StateLayout.state_dict``) at ``step``."""
    d = rank_dir(root, step, rank)
    d.mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(d), no_dist=True)
    extra = {k: v for k, v in header.items() if isinstance(v, (int, float, str))}
    (d / "header.json").write_text(json.dumps(extra))
    torch.save({"rng_cpu": header.get("rng_cpu")}, d / "rng.pt")
    return d


def write_meta(root, step: int, world_size: int, reason: str) -> None:
    p = Path(root) / f"step_{step}"
    p.mkdir(parents=True, exist_ok=True)
    (p / "meta.json").write_text(json.dumps({"step": step, "world_size": world_size, "reason": reason}))


def is_complete(step_dir: Path) -> bool:
    """Every rank named by meta.json finished writing (its header.json is written last)."""
    try:
        meta = json.loads((step_dir / "meta.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    n = meta.get("world_size")
    return isinstance(n, int) and all((step_dir / f"rank_{r}" / "header.json").exists() for r in range(n))


def latest_step_dir(root) -> Path:
    """The newest complete checkpoint under ``root`` (or ``root`` itself if it is one)."""
    root = Path(root)
    if (root / "meta.json").exists():
        if not is_complete(root):
            raise FileNotFoundError(f"checkpoint {root} is incomplete (a rank's state is missing)")
        return root
    steps = sorted((p for p in root.glob("step_*") if is_complete(p)),
                   key=lambda p: int(p.name.split("_")[1]))
    if not steps:
        raise FileNotFoundError(f"no complete DeadPool checkpoint (step_*/meta.json + every rank) under {root}")
    return steps[-1]


def load_rank_state(step_dir: Path, rank: int, state: dict[str, torch.Tensor]) -> dict:
    """Load rank ``rank``'s tensors in place into ``state``; returns the header."""
    d = step_dir / f"rank_{rank}"
    if not d.exists():
        raise FileNotFoundError(f"checkpoint {step_dir} has no state for rank {rank}")
    dcp.load(state, checkpoint_id=str(d), no_dist=True)
    header = json.loads((d / "header.json").read_text())
    rng = torch.load(d / "rng.pt", weights_only=False)
    header.update(rng)
    return header
