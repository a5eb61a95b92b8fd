"""Interleaved 1F1B with real processes: dp2 x pp2, two virtual stages per rank, a warm spare.

A tiny 4-layer model cut into four chunks (rank pp 0 holds layers 0 and 2, pp 1 layers 1 and 3),
ZeRO-1 over dp so every rank's state is its own. The last stage of one replica is SIGKILLed
in the interleaved cool-down (its backwards waiting on gradients from the wrap-around group),
and the job must end bitwise equal to its failure-free run. The failure-free run is also
compared with plain 1F1B on the same micro-batches: the loss curve and the exported model
(every parameter whole, from each run's final checkpoint) must be bitwise the same, because
the schedules differ only in when each micro-batch runs, not in what it computes
(``deadpool/parallel/pipeline/interleaved.py``).
"""

from __future__ import annotations

import json

import pytest
import torch

from deadpool.export import export
from deadpool.export.consolidate import load_source
from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states, load_final_rank
from tests.conftest import compose_train

BASE = ["model=tiny", "model.n_layers=4", "parallel=dp2", "parallel.pp=2",
        "parallel.microbatches=4", "num_steps=6", "ft.num_spares=1", "log_every_steps=0"]
V2 = BASE + ["parallel.virtual_stages=2"]
quiet = lambda *a, **k: None  # noqa: E731


def losses(run_dir) -> dict[tuple[int, int], float]:
    """(step, rank) -> the loss a last-stage rank logged (its own batch's)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["loss"] is not None:
            out[r["step"], r["rank"]] = r["loss"]
    return out


@pytest.mark.slow
def test_interleaved_hot_swap_is_bitwise_and_its_run_is_1f1b(tmp_path):
    ref = run_job(compose_train(V2 + ["faults=none"], tmp_path / "ref"), log=quiet)
    assert ref["outcome"] == "completed" and not ref["recoveries"], ref.get("message")
    # rank 2 = (pp 1, dp 0): the last stage, in its cool-down backwards of step 3
    kill = "faults.events=[{rank: 2, step: 3, phase: pp_cooldown, kind: kill}]"
    run = run_job(compose_train(V2 + [kill], tmp_path / "run"), log=quiet)
    assert run["outcome"] == "completed", run["message"]
    (rec,) = run["recoveries"]
    assert rec["failed_rank"] == 2 and rec["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path / "run", tmp_path / "ref")
    assert equal, why
    # every rank's state is its own (ZeRO-1 shards, and the stages' layers): a wrong route fails
    states = [load_final_rank(tmp_path / "ref", r) for r in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            sa, sb = states[a], states[b]
            assert any(k not in sb or sa[k].shape != sb[k].shape or not torch.equal(sa[k], sb[k])
                       for k in sa), (a, b)
    # the interleaved layout is what ran: rank 0 holds layers 0 and 2 (meta.json records v)
    cfg, dims, _, _ = load_source(tmp_path / "ref")
    assert dims.virtual_stages == 2 and dims.layout["virtual_stages"] == 2
    # plain 1F1B, same micro-batches: the same model and loss curve, bit for bit
    plain = run_job(compose_train(BASE + ["faults=none"], tmp_path / "plain"), log=quiet)
    assert plain["outcome"] == "completed"
    curve = losses(tmp_path / "ref")
    assert len(curve) == 6 * 2 and curve == losses(tmp_path / "plain")
    # exported (whole tensors in the model's order, from every rank's final checkpoint)
    for run in ("ref", "plain"):
        export(tmp_path / run, tmp_path / f"hf_{run}", log=quiet)
    files = sorted(p.name for p in (tmp_path / "hf_ref").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "hf_plain").glob("*.safetensors"))
    for f in files:
        assert (tmp_path / "hf_ref" / f).read_bytes() == (tmp_path / "hf_plain" / f).read_bytes()
