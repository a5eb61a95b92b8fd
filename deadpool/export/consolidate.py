"""Full, unsharded parameters from a run's ``final/`` or a DeadPool checkpoint.

Each rank's state holds its (pp, tp) stage's parameters as one flat buffer ``params`` (ZeRO-1:
padded, identical on every data-parallel replica), in the order of that stage's
``named_parameters()`` (``ZeroOptimizer``). This module rebuilds the stage's module on the meta
device to learn the names, shapes and order, and asks the sharding code itself where each
element goes: ``tensor.layers.shard`` applied to a tensor of element indices of the full
parameter returns exactly the indices the rank's slice holds. Nothing here restates the slicing
rule, so a change to ``shard`` (or to which layers a stage holds) is followed, and every element
of every full parameter must be written exactly once (replicated norms: equal on every
tensor-parallel rank) or the export is refused.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path

import torch

from deadpool import checkpoint
from deadpool.checkpoint.unique import PART, read_full_rank
from deadpool.model import GPT, model_config
from deadpool.parallel.stage import StageModel
from deadpool.parallel.tensor.layers import shard
from deadpool.topology import ParallelDims


class ExportError(ValueError):
    """The source cannot be exported: the message says why."""


def find_job(start: Path) -> Path | None:
    """The ``job.json`` of the run a checkpoint directory lies in (its nearest ancestor's)."""
    for d in [start, *start.parents]:
        if (d / "job.json").exists():
            return d / "job.json"
    return None


def load_source(src, job: Path | None = None) -> tuple[dict, ParallelDims, dict[int, dict], str]:
    """``(cfg, dims, states, what)`` of a run directory (its final checkpoint ``final/``, or
    ``final/rank*.pt`` of a run from before it was one) or a checkpoint
    (a ``step_<S>`` directory, or a root holding them: its newest complete step). ``states``:
    rank -> tensors (``params`` may be missing from a rank written from a buddy's replica)."""
    src = Path(src)
    if not src.exists():
        raise ExportError(f"{src}: no such directory")
    job = Path(job) if job else find_job(src)
    if job is None:
        raise ExportError(f"{src}: no job.json here or above it; pass --job RUN_DIR/job.json "
                          "(the run's resolved config: model size and layout)")
    cfg = json.loads(job.read_text())
    legacy = (src / "final").is_dir() and any((src / "final").glob("rank*.pt"))
    if legacy and not (src / checkpoint.META_FILE).exists():  # a run of before final/step_<S>
        dims = ParallelDims.from_config(cfg["parallel"])
        states = {}
        for r in range(dims.world_size):
            f = src / "final" / f"rank{r}.pt"
            if not f.exists():
                raise ExportError(f"{f} is missing: the run did not finish (export a checkpoint "
                                  "directory instead)")
            # memory-mapped: a tensor's bytes are read when consolidation reaches it
            states[r] = torch.load(f, weights_only=True, mmap=True)
        return cfg, dims, states, f"{src}/final"
    if (src / "final").is_dir() and not (src / checkpoint.META_FILE).exists():
        src = src / "final"  # the run's final checkpoint (checkpoint.final)
    try:
        step_dir = checkpoint.latest_step_dir(src)
    except FileNotFoundError as e:
        raise ExportError(f"{src}: neither a run directory with final/ nor a checkpoint ({e})") from None
    meta = checkpoint.read_meta(step_dir)
    layout = meta.get("layout") or cfg["parallel"]
    dims = ParallelDims.from_layout(layout)
    if dims.world_size != int(meta["world_size"]):
        raise ExportError(f"{step_dir}: meta.json's layout {layout} does not match its world size "
                          f"{meta['world_size']}")
    return cfg, dims, StageStates(step_dir, dims), str(step_dir)


class StageStates(dict):
    """rank -> tensors of a checkpoint, read when first asked for; asking for a rank of another
    pipeline stage drops the ranks held (consolidation goes stage by stage, so at most one
    stage's ranks are in memory)."""

    def __init__(self, step_dir, dims: ParallelDims):
        super().__init__()
        self.step_dir, self.dims = step_dir, dims

    def __missing__(self, rank: int) -> dict:
        pp = self.dims.coords(rank)["pp"]
        for r in [r for r in self if self.dims.coords(r)["pp"] != pp]:
            del self[r]
        if self.dims.coords(rank)["dp"] == 0:  # a final checkpoint's spread parts joined here
            self[rank] = read_full_rank(self.step_dir, rank)[0]
        else:  # (once per group: the other replicas give their unique tensors only)
            st = checkpoint.read_rank_state(self.step_dir, rank)[0]
            self[rank] = {k: v for k, v in st.items() if not k.endswith(PART)}
        return self[rank]

    def values(self):  # every rank, one stage at a time
        return (self[r] for r in range(self.dims.world_size))


def stage_params(cfg, pp_rank: int, pp: int, tp_rank: int, tp: int,
                 virtual_stages: int = 1) -> list[tuple[str, torch.Size]]:
    """(name, local shape) of a stage's parameters, in ``named_parameters()`` order (a chunked
    stage's: its chunks' layers, ``virtual_stages``)."""
    with torch.device("meta"):
        stage = StageModel(model_config(cfg), pp_rank=pp_rank, pp=pp, tp_rank=tp_rank, tp=tp,
                           virtual_stages=virtual_stages)
    return [(n, p.shape) for n, p in stage.named_parameters()]


def stage_flat(dims: ParallelDims, states: dict[int, dict], pp_rank: int, tp_rank: int,
               source: str) -> tuple[torch.Tensor, int]:
    """The flat parameter buffer of stage (pp, tp) and a rank it came from. ``source="params"``:
    any data-parallel replica's ``params``. ``"master"``: the fp32 master weights of a
    mixed-precision run, whole on one rank or, under ZeRO-1, one shard per data-parallel rank
    (concatenated in dp order)."""
    ranks = [dims.rank_of(pp_rank, d, tp_rank) for d in range(dims.dp)]
    if source == "params":
        holder = next((r for r in ranks if "params" in states[r]), None)
        if holder is None:
            raise ExportError(f"no rank of stage (pp {pp_rank}, tp {tp_rank}) holds its "
                              f"parameters (ranks {ranks})")
        return states[holder]["params"].reshape(-1), holder
    holders = [r for r in ranks if "master" in states[r]]
    params = next((states[r]["params"] for r in ranks if "params" in states[r]), None)
    if holders and params is not None and states[holders[0]]["master"].numel() == params.numel():
        # not sharded: every replica holds all of it (a unique-state checkpoint: dp rank 0 only)
        return states[holders[0]]["master"].reshape(-1), holders[0]
    if len(holders) != len(ranks):
        raise ExportError(f"stage (pp {pp_rank}, tp {tp_rank}) has no master weights on every "
                          f"rank {ranks} (not a mixed-precision run?)")
    return torch.cat([states[r]["master"].reshape(-1) for r in ranks]), ranks[0]


def full_parameters(model_cfg, dims: ParallelDims, states: dict[int, dict],
                    source: str = "params") -> dict[str, torch.Tensor]:
    """Every parameter of the single-process model (``deadpool.model.GPT`` names), whole, in the
    dtype of ``source`` (``stage_flat``)."""
    return dict(iter_full_parameters(model_cfg, dims, states, source))


def iter_full_parameters(model_cfg, dims: ParallelDims, states: dict[int, dict],
                         source: str = "params"):
    """``(name, full parameter)`` one at a time, in ``GPT.named_parameters()`` order: only the
    parameter being assembled is held, the ranks' buffers are read in place (memory-mapped
    ``final/`` files; a checkpoint's ranks one stage at a time, ``StageStates``). Stage by stage
    without interleaving; with ``virtual_stages`` v a rank's layers are not contiguous, so its
    stage is visited v times (a checkpoint's ranks read again each time)."""
    mcfg = model_config(model_cfg)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in GPT(mcfg).named_parameters()}
    # a shard() that splits q/k/v by the config's head counts (grouped-query attention) takes it
    extra = {"model_cfg": mcfg} if "model_cfg" in inspect.signature(shard).parameters else {}
    where: dict[str, tuple[int, list[tuple[int, int]]]] = {}  # name -> (pp, [(offset, n)] per tp)
    need: dict[tuple[int, int], int] = {}  # (pp, tp) -> elements of that stage's parameters
    for pp_rank in range(dims.pp):
        for tp_rank in range(dims.tp):
            off = 0
            for name, shape in stage_params(mcfg, pp_rank, dims.pp, tp_rank, dims.tp,
                                            dims.virtual_stages):
                where.setdefault(name, (pp_rank, []))[1].append((off, shape.numel()))
                off += shape.numel()
            need[pp_rank, tp_rank] = off
    unknown = sorted(set(where) - set(shapes))
    if unknown:
        raise ExportError(f"stages hold parameters the model has not: {unknown}")
    held, flats = None, []
    for name in [n for n in shapes if n in where]:
        pp_rank, pieces = where[name]
        if pp_rank != held:
            flats = [stage_flat(dims, states, pp_rank, tp_rank, source)
                     for tp_rank in range(dims.tp)]
            for tp_rank, (flat, holder) in enumerate(flats):
                # ZeRO-1 pads the flat buffer to a multiple of dp; more left over is another model
                if not 0 <= flat.numel() - need[pp_rank, tp_rank] < max(dims.dp, 64):
                    raise ExportError(f"rank {holder}: params holds {flat.numel()} elements, its "
                                      f"stage {need[pp_rank, tp_rank]} (the model config does "
                                      "not match the state)")
            held = pp_rank
        yield name, _assemble(name, shapes[name], flats, pieces, dims.tp, extra)
    missing = sorted(set(shapes) - set(where))
    if missing:
        raise ExportError(f"parameters not (fully) covered by the shards: {missing}")


def _assemble(name: str, shape, flats, pieces, tp: int, extra: dict) -> torch.Tensor:
    """One whole parameter from its tensor-parallel slices (``pieces``: (offset, numel) in each
    tp rank's flat buffer), each element written once (replicated ones: equal on every rank)."""
    full = written = None
    for tp_rank, ((flat, holder), (off, n)) in enumerate(zip(flats, pieces)):
        local = flat[off:off + n]
        if full is None:
            full = torch.empty(shape, dtype=flat.dtype)
            written = torch.zeros(shape.numel(), dtype=torch.bool)
        index = torch.arange(shape.numel()).view(shape)
        where = shard(name, index, tp_rank, tp, **extra).reshape(-1)
        del index
        if where.numel() != n:
            raise ExportError(f"{name}: rank {holder} holds {n} elements, the sharding "
                              f"code says {where.numel()}")
        dst = full.view(-1)
        again = written[where]
        if again.any() and not torch.equal(dst[where][again], local[again]):
            raise ExportError(f"{name}: replicated copies differ between tensor-parallel "
                              f"ranks (rank {holder})")
        dst[where] = local
        written[where] = True
    if not written.all():
        raise ExportError(f"parameters not (fully) covered by the shards: {[name]}")
    return full
