"""Resume at another layout with real processes (issue 37): a dp2 x tp2 x pp2 job's checkpoint of
step 4, resumed with ``ft.resume_from`` at dp4, at dp2 x tp4 and at dp2 x pp4.

Two references:

* bitwise: the same state written at the new layout beforehand (``relayout.relayout_state``
  per rank, as the unit test ``tests/deadpool/checkpoint/test_relayout.py`` checks against an
  independent construction), resumed at that layout without any re-cut: the loss of every step
  and the final state equal (the resume path routes each rank its own state);
* against the uninterrupted dp2 x tp2 x pp2 run: at dp2 the global batch is the same, so the
  losses after the resume agree within 1e-4 (relative). Not bitwise: tp4 splits each row-parallel
  matmul into four partial sums instead of two, and pp4 a stage boundary moves, so the sums
  round differently (measured at tp4: steps 5-7 equal, step 8 8e-8 relative).
  At dp4 every step draws four batches where dp2 drew two: another loss, so no such check.
"""

from __future__ import annotations

import json
import math

import pytest

from deadpool import checkpoint
from deadpool.checkpoint.relayout import relayout_state
from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from deadpool.model import model_config
from deadpool.topology import ParallelDims
from tests.conftest import compose_train

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

MODEL = ["model=tiny", "model.n_layers=4", "parallel.microbatches=4", "log_every_steps=0",
         "ft=none", "num_steps=8"]
OLD = (2, 2, 2)
quiet = lambda *a, **k: None  # noqa: E731


def _par(dp, tp, pp):
    return [f"parallel.dp={dp}", f"parallel.tp={tp}", f"parallel.pp={pp}"]


def _losses(run) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    by = {}
    for r in rows:
        if r.get("loss") is not None:
            by.setdefault(r["step"], []).append(r["loss"])
    return {s: math.fsum(v) / len(v) for s, v in sorted(by.items())}  # any row order


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    run = tmp_path_factory.mktemp("old")
    s = run_job(compose_train(MODEL + _par(*OLD) + ["ft.persist_interval_steps=4",
                                                    "ft.persist_async=false",
                                                    "ft.keep_checkpoints=0"], run), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    return run


def _prewritten(original, new: ParallelDims, root):
    """Step 4 of ``original`` written at ``new`` ahead of the job (the bitwise reference)."""
    step_dir = original / "checkpoints" / "step_4"
    old = ParallelDims(*OLD, ranks_per_node=2)
    cfg = json.loads((original / "job.json").read_text())
    mcfg = model_config(cfg["model"])
    for r in range(new.world_size):
        header = checkpoint.read_header(step_dir, 0)
        header.pop("written_at"), header.pop("shared_from", None)
        checkpoint.save_rank_state(root, 4, r, relayout_state(step_dir, old, new, r, mcfg, True),
                                   header, layout=new.layout, world_size=new.world_size)
    checkpoint.write_meta(root, 4, new.world_size, "periodic", layout=new.layout)
    return root / "step_4"


@pytest.mark.parametrize("new", [(4, 1, 1), (2, 4, 1), (2, 1, 4)], ids=["dp4", "tp4", "pp4"])
def test_resume_a_3d_checkpoint_at_another_layout(original, tmp_path, new):
    dims = ParallelDims(*new, ranks_per_node=new[1])
    run = tmp_path / "resumed"
    s = run_job(compose_train(MODEL + _par(*new) + [
        f"ft.resume_from={original / 'checkpoints' / 'step_4'}"], run), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    got = _losses(run)
    assert sorted(got) == [5, 6, 7, 8]
    ref = tmp_path / "ref"
    s = run_job(compose_train(MODEL + _par(*new) + [
        f"ft.resume_from={_prewritten(original, dims, tmp_path / 'ckpt')}"], ref), log=quiet)
    assert s["outcome"] == "completed", s["message"]
    assert got == _losses(ref)
    equal, why = compare_final_states(run, ref)
    assert equal, why
    if new[0] == OLD[0]:  # the same global batch: the uninterrupted run's losses, rounding apart
        before = _losses(original)
        for step in (5, 6, 7, 8):
            assert got[step] == pytest.approx(before[step], rel=1e-4), (step, got, before)
