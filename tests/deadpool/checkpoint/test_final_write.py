"""A rank's final write (issue 37, the end of a job).

``Worker.write_final`` writes the job's final state as one checkpoint of unique state
(``checkpoint.final``): a tensor every data-parallel replica holds is written once, its parts
spread over the replicas, each rank's unique tensors by itself, and each rank's header carries
the digest of its whole state. It bumps the rank's progress while it writes (so the
coordinator's wait, ``recovery.finish``, sees a slow disk progressing), never leaves a partial
rank directory under its name, and the result resumes (``rank_state.load``), exports
(``export.consolidate``) and compares (``report.compare_final_states``) like any checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import types
from types import SimpleNamespace

import pytest
import torch

from deadpool import checkpoint
from deadpool.checkpoint import final, rank_state
from deadpool.checkpoint.unique import PART
from deadpool.launch.report import final_ranks, load_final_rank
from deadpool.rank.watchdog import Progress
from deadpool.rank.worker import Worker
from deadpool.store.protocol import Keys
from deadpool.topology import ParallelDims

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

NUMEL = 1000  # parameters of a stage (not a multiple of dp 3: uneven parts)


def zero_state(dims: ParallelDims, rank: int) -> dict[str, torch.Tensor]:
    """ZeRO-1 state of ``rank``: ``params`` one flat buffer, equal across its data-parallel
    group (different between stages); ``exp_avg`` and ``step`` distinct on every rank."""
    c = dims.coords(rank)
    g = torch.Generator().manual_seed(100 * c["pp"] + 10 * c["tp"])
    flat = torch.randn(NUMEL, generator=g)
    g = torch.Generator().manual_seed(1000 + rank)
    shard = -(-NUMEL // dims.dp)
    return {"params": flat, "exp_avg": torch.randn(shard, generator=g),
            "exp_avg_sq": torch.rand(shard, generator=g), "step": torch.tensor(float(7 + rank))}


def digest(state: dict[str, torch.Tensor]) -> str:
    """A rank's digest of its whole state (``Trainer.digest``'s rule)."""
    h = hashlib.sha256()
    for t in state.values():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fake_worker(run_dir, dims: ParallelDims, rank: int, state: dict[str, torch.Tensor],
                shared=("params",)):
    """What ``Worker.write_final`` reads of a worker and its trainer."""
    records, fired = {}, []
    engine = SimpleNamespace(persister=None, layout=SimpleNamespace(nbytes=sum(
        t.numel() * t.element_size() for t in state.values())), replicated_bytes=0)
    trainer = SimpleNamespace(
        engine=engine, step=7, params=[state["params"]], state_dict=lambda: state,
        digest=lambda: digest(state), shared_names=lambda: list(shared),
        header=lambda: {"step": 7, "rank": rank, "data_position": 7, "generation": 0})
    injector = SimpleNamespace(fire=lambda step, phase: fired.append((step, phase)))
    w = SimpleNamespace(trainer=trainer, run_dir=run_dir, progress=Progress(), slot=rank,
                        dims=dims, injector=injector,
                        _set_sealed=lambda k, v: records.__setitem__(k, v))
    return w, records, fired


def write_run(run_dir, dims: ParallelDims, states: dict[int, dict]) -> dict[int, dict]:
    """Every rank's ``Worker.write_final`` (ranks one after another); their records."""
    out = {}
    for r in range(dims.world_size):
        w, records, _ = fake_worker(run_dir, dims, r, states[r])
        Worker.write_final(w, r)
        out[r] = json.loads(records[Keys.final(r)])
    return out


def throttled_open(delay_s: float):
    """``open`` whose files take ``delay_s`` per write (a slow shared file system)."""
    class Slow:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            time.sleep(delay_s)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opener(path, mode="r", *a, **k):
        return Slow(open(path, mode, *a, **k))
    return opener


@pytest.mark.parametrize("dp,tp,pp", [(4, 1, 1), (3, 2, 1), (2, 2, 2)])
def test_replicated_tensors_are_written_once_spread_over_the_replicas(tmp_path, dp, tp, pp):
    dims = ParallelDims(dp, tp, pp, ranks_per_node=tp)
    states = {r: zero_state(dims, r) for r in range(dims.world_size)}
    records = write_run(tmp_path, dims, states)
    step_dir = tmp_path / "final" / "step_7"
    assert checkpoint.is_complete(step_dir) and final_ranks(tmp_path) == list(range(dims.world_size))
    param_bytes = NUMEL * 4
    for r in range(dims.world_size):
        written, header = checkpoint.read_rank_state(step_dir, r)
        assert "params" not in written and header["digest"] == digest(states[r])
        # each replica writes about 1/dp of its group's parameters: no rank writes them all
        assert written["params" + PART].numel() in (NUMEL // dp, NUMEL // dp + 1)
        assert torch.equal(written["exp_avg"], states[r]["exp_avg"])
        assert records[r]["digest"] == digest(states[r])
        # (files: the tensors, plus DCP's metadata and the header)
        assert records[r]["written_bytes"] > sum(t.numel() * t.element_size()
                                                 for t in written.values())
    groups = tp * pp
    tensor_bytes = sum(t.numel() * t.element_size() for r in range(dims.world_size)
                       for t in checkpoint.read_rank_state(step_dir, r)[0].values())
    every_copy = sum(t.numel() * t.element_size() for s in states.values() for t in s.values())
    # the replicated share once per (pp, tp) group instead of dp times, nothing else dropped
    assert tensor_bytes == every_copy - (dp - 1) * groups * param_bytes
    for r in range(dims.world_size):  # every rank's whole state back, bitwise
        got = load_final_rank(tmp_path, r)
        assert got.keys() == states[r].keys()
        assert all(torch.equal(got[k], states[r][k]) for k in got), r


class _Trainer:
    """What ``rank_state.load`` needs of a rank: its live state (zeros until loaded)."""

    def __init__(self, dims, rank):
        self._state = {k: torch.zeros_like(v) for k, v in zero_state(dims, rank).items()}
        self.header = None
        self.opt = types.SimpleNamespace(numel=NUMEL, shard=True)

    def state_dict(self):
        return self._state

    def shared_names(self):
        return ["params"]

    def apply_header(self, header):
        self.header = header


def test_the_final_state_resumes_like_any_checkpoint(tmp_path):
    """``ft.resume_from=<run>/final``: every rank loads its own state, its parameters joined
    from the parts its replicas wrote; and at another data-parallel width (re-cut shards)."""
    dims = ParallelDims(2, 2, 1, ranks_per_node=2)
    states = {r: zero_state(dims, r) for r in range(4)}
    write_run(tmp_path, dims, states)
    for r in range(4):
        tr = _Trainer(dims, r)
        rank_state.load(tr, dims, tmp_path / "final", r)
        assert all(torch.equal(tr.state_dict()[k], v) for k, v in states[r].items()), r
        assert tr.header["step"] == 7 and tr.header["rank"] == r
    one = ParallelDims(1, 2, 1, ranks_per_node=2)
    for r in range(2):  # dp 2 -> 1: the two shards of exp_avg joined, the parameters whole
        tr = _Trainer(one, r)
        rank_state.load(tr, one, tmp_path / "final", r)
        assert torch.equal(tr.state_dict()["params"], states[r]["params"])
        pair = [dims.rank_of(0, d, r) for d in range(2)]
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(tr.state_dict()[k], torch.cat([states[q][k] for q in pair])), k


def test_the_final_state_exports_through_consolidation(tmp_path):
    """A dp2 x tp2 x pp2 run's final checkpoint gives every parameter of the single-process
    model back (``export.consolidate``: the parts joined on each group's dp rank 0)."""
    from deadpool.export.consolidate import full_parameters, load_source, stage_params
    from deadpool.model import build_model, model_config
    from deadpool.parallel.tensor.layers import shard

    mcfg = {"vocab_size": 48, "d_model": 32, "n_layers": 2, "n_heads": 4, "ffn_mult": 4,
            "max_seq_len": 16}
    model = build_model(mcfg, 3)
    named = dict(model.named_parameters())
    dims = ParallelDims(2, 2, 2, ranks_per_node=2)
    states = {}
    for r in range(dims.world_size):
        c = dims.coords(r)
        flat = torch.cat([shard(n, named[n].detach(), c["tp"], 2, model_cfg=model_config(mcfg))
                          .reshape(-1) for n, _ in stage_params(model_config(mcfg), c["pp"], 2,
                                                                c["tp"], 2)] + [torch.zeros(1)])
        states[r] = {"params": flat, "exp_avg": torch.full((4,), float(r)), "step": torch.tensor(3.)}
    write_run(tmp_path, dims, states)
    (tmp_path / "job.json").write_text(json.dumps({"model": mcfg, "seed": 3, "parallel": {
        "dp": 2, "tp": 2, "pp": 2}}))
    cfg, got_dims, loaded, _ = load_source(tmp_path)
    assert (got_dims.dp, got_dims.tp, got_dims.pp) == (2, 2, 2)
    full = full_parameters(cfg["model"], got_dims, loaded)
    assert full.keys() == named.keys()
    assert all(torch.equal(full[n], named[n].detach()) for n in named)


def test_a_slow_final_write_shows_progress_while_it_writes(tmp_path, monkeypatch):
    """A throttled disk (every write delayed): the writer's progress keeps changing, the fault
    hook ``final`` fires once its first bytes are on disk, and what lands is bitwise the state."""
    monkeypatch.setattr(final, "open", throttled_open(0.01), raising=False)
    monkeypatch.setattr(final, "CHUNK_BYTES", 1024, raising=False)
    dims = ParallelDims(2)
    st = zero_state(dims, 1)
    w, records, fired = fake_worker(tmp_path, dims, 1, st)
    seen, done = set(), threading.Event()

    def heartbeat():  # what the heartbeat thread publishes, every 10 ms
        while not done.is_set():
            seen.add(w.progress.count)
            time.sleep(0.01)
    beat = threading.Thread(target=heartbeat)
    beat.start()
    try:
        Worker.write_final(w, 1)
    finally:
        done.set()
        beat.join()
    assert len(seen) >= 5, f"the heartbeat saw progress values {sorted(seen)} during the write"
    assert w.progress.phase.startswith("final") and fired == [(7, "final")]
    written, header = checkpoint.read_rank_state(tmp_path / "final" / "step_7", 1)
    assert torch.equal(written["exp_avg"], st["exp_avg"])
    assert torch.equal(written["params" + PART], st["params"][NUMEL // 2:])
    assert written["exp_avg"].untyped_storage().nbytes() == st["exp_avg"].numel() * 4
    rec = json.loads(records[Keys.final(1)])
    assert rec["digest"] == header["digest"] == digest(st) and rec["step"] == 7


def test_a_failed_final_write_leaves_no_rank_directory(tmp_path, monkeypatch):
    def broken_open(path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)

        class Full:
            def write(self, b):
                raise OSError(28, "No space left on device")

            def __getattr__(self, name):
                return getattr(f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()
        return Full()
    monkeypatch.setattr(final, "open", broken_open, raising=False)
    dims = ParallelDims(1)
    w, records, _ = fake_worker(tmp_path, dims, 0, zero_state(dims, 0))
    with pytest.raises(checkpoint.CheckpointWriteError, match="No space left"):
        Worker.write_final(w, 0)
    step_dir = tmp_path / "final" / "step_7"
    assert not (step_dir / "rank_0").exists() and not records
    assert not step_dir.exists() or not any(step_dir.iterdir())
