"""Resume at another parallel layout: dp, tp, pp and the virtual stages may all change.

A checkpoint holds, per rank, its (pp, tp) stage's parameters as one flat buffer (in the stage's
``named_parameters()`` order, padded for ZeRO-1) and its optimizer state: the fp32 ``master``
weights (mixed precision) and AdamW's ``exp_avg`` / ``exp_avg_sq``, each the rank's ZeRO-1 shard
of a buffer parallel to the parameters, or the whole buffer. A rank of the new layout rebuilds its
own state from the old one in three steps, all exact (copies, no arithmetic):

    1 old stage -> whole stage     every data-parallel rank of each old stage that holds one of
                                   the new stage's parameters; ZeRO shards joined
                                   (``parallel.data.reshard.reshard_state`` at width 1)
    2 stages -> whole tensors      per parameter and per state kind, the old tensor-parallel
                                   slices joined (``tensor.layers.unshard``, the inverse of
                                   ``shard``): the single-process model's tensors
    3 whole -> this rank           ``shard`` for the new tensor-parallel rank, concatenated in
                                   the new stage's order, then cut for its data-parallel shard
                                   (``reshard_state`` at the new width)

The stage's parameter names and shapes come from building it on the meta device
(``parallel.stage.StageModel``), so nothing here restates which layers a stage holds or how a
tensor is sliced. AdamW's moments are elementwise, so a moment moves with its element like the
parameter does; the step count is one number. A rank reads only the old stages it needs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from deadpool.checkpoint.unique import read_full_rank
from deadpool.checkpoint.files import read_header
from deadpool.topology import ParallelDims

KINDS = ("params", "master", "exp_avg", "exp_avg_sq")  # buffers parallel to the parameters


def stage_params(mcfg, pp_rank: int, pp: int, tp_rank: int, tp: int,
                 virtual_stages: int = 1) -> list[tuple[str, torch.Size]]:
    """(name, local shape) of a stage's parameters, in ``named_parameters()`` order (a chunked
    stage's blocks are its chunks' layers: which ones depends on ``virtual_stages``)."""
    from deadpool.parallel.stage import StageModel

    with torch.device("meta"):
        stage = StageModel(mcfg, pp_rank=pp_rank, pp=pp, tp_rank=tp_rank, tp=tp,
                           virtual_stages=virtual_stages)
    return [(n, p.shape) for n, p in stage.named_parameters()]


def split_flat(flat: torch.Tensor, params) -> dict[str, torch.Tensor]:
    """A stage's flat buffer -> its tensors by name (``params``: ``stage_params``)."""
    out, off = {}, 0
    for name, shape in params:
        n = shape.numel()
        out[name] = flat[off:off + n].view(shape)
        off += n
    return out


def whole_stage(step_dir: Path, old: ParallelDims, pp_rank: int, tp_rank: int,
                numel: int) -> dict[str, torch.Tensor]:
    """Stage (pp, tp)'s state at data-parallel width 1 (ZeRO shards of every old dp rank joined)."""
    from deadpool.parallel.data.reshard import reshard_state

    states = [read_full_rank(step_dir, old.rank_of(pp_rank, d, tp_rank))[0] for d in range(old.dp)]
    return reshard_state(states, numel, 1, 0, shard=False)


def full_tensors(step_dir: Path, old: ParallelDims, mcfg, names) -> tuple[dict, torch.Tensor]:
    """``{kind: {name: whole tensor}}`` of the parameters ``names`` (single-process model
    names) from a checkpoint written at ``old``, and the optimizer's step count."""
    from deadpool.parallel.tensor.layers import unshard

    names = set(names)
    full: dict[str, dict[str, torch.Tensor]] = {}
    step = None
    for pp_rank in range(old.pp):
        if not names & {n for n, _ in stage_params(mcfg, pp_rank, old.pp, 0, old.tp,
                                                   old.virtual_stages)}:
            continue  # a rank reads only the old stages it needs
        pieces: dict[str, dict[str, list]] = {}
        for tp_rank in range(old.tp):
            params = stage_params(mcfg, pp_rank, old.pp, tp_rank, old.tp, old.virtual_stages)
            numel = sum(s.numel() for _, s in params)
            st = whole_stage(step_dir, old, pp_rank, tp_rank, numel)
            step = st["step"] if step is None else step
            for kind in KINDS:
                if kind in st:
                    for name, t in split_flat(st[kind].reshape(-1)[:numel], params).items():
                        if name in names:
                            pieces.setdefault(kind, {}).setdefault(name, []).append(t)
        for kind, by_name in pieces.items():
            for name, parts in by_name.items():
                full.setdefault(kind, {})[name] = unshard(name, parts, model_cfg=mcfg)
    missing = names - set(full.get("params", {}))
    if missing:
        raise ValueError(f"{step_dir}: no stage of its layout holds {sorted(missing)}")
    return full, step


def relayout_state(step_dir: Path, old: ParallelDims, new: ParallelDims, rank: int, mcfg,
                   shard_optimizer: bool) -> dict[str, torch.Tensor]:
    """Rank ``rank`` of layout ``new``'s state (``ZeroOptimizer.state_tensors`` names) from a
    checkpoint written at ``old`` (module docstring)."""
    from deadpool.parallel.data.reshard import reshard_state
    from deadpool.parallel.tensor.layers import shard

    c = new.coords(rank)
    params = stage_params(mcfg, c["pp"], new.pp, c["tp"], new.tp, new.virtual_stages)
    full, step = full_tensors(step_dir, old, mcfg, [n for n, _ in params])
    stage = {kind: torch.cat([shard(n, by_name[n], c["tp"], new.tp, model_cfg=mcfg).reshape(-1)
                              for n, _ in params])
             for kind, by_name in full.items()}
    stage["step"] = step
    numel = sum(s.numel() for _, s in params)
    return reshard_state([stage], numel, new.dp, c["dp"], shard_optimizer)


def load_relayout(trainer, dims: ParallelDims, step_dir: Path, rank: int, layout: dict) -> None:
    """Load a checkpoint written at another tensor- or pipeline-parallel layout into ``trainer``
    (``rank_state.load``'s case for it)."""
    from deadpool.model import model_config

    old = ParallelDims.from_layout(layout)
    new = relayout_state(step_dir, old, dims, rank, model_config(trainer.cfg["model"]),
                         trainer.opt.shard)
    for name, t in trainer.state_dict().items():
        t.copy_(new[name].reshape(t.shape))
    header = read_header(step_dir, 0)
    header.pop("written_at", None)
    header.pop("shared_from", None)
    trainer.apply_header(header)
