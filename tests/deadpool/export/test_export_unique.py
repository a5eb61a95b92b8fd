"""Export of a unique-state checkpoint (issue 37): the parameters and, without ZeRO, the fp32
master weights are in each (pp, tp) group's dp rank 0 directory only."""

from __future__ import annotations

import json

import pytest
import torch

from deadpool import checkpoint
from deadpool.checkpoint.unique import unique_part
from deadpool.export import export
from deadpool.export.consolidate import full_parameters, load_source
from deadpool.topology import ParallelDims
from tests.deadpool.export.test_export import MODEL, rank_states, trained_like

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_a_unique_state_checkpoint_exports_its_master_weights(tmp_path):
    model = trained_like(23)
    dims = ParallelDims(2, 2, 2, ranks_per_node=2)
    root = tmp_path / "run" / "checkpoints"
    for r, st in rank_states(model, dims).items():
        st = dict(st, master=st["params"].clone() + 1.0)  # not sharded (parallel.zero=false)
        st, hdr = unique_part(st, {"step": 3}, ("params", "master", "exp_avg", "step"),
                              dims.layout, r)
        checkpoint.save_rank_state(root, 3, r, st, hdr, layout=dims.layout, world_size=8)
    checkpoint.write_meta(root, 3, 8, "periodic", layout=dims.layout)
    (tmp_path / "run" / "job.json").write_text(json.dumps(
        {"model": MODEL, "seed": 5, "parallel": dims.layout, "data": {"name": "synthetic"}}))
    cfg, d, states, _ = load_source(root)
    assert "params" not in states[2] and "master" not in states[2]  # rank 2: dp 1 of stage (0, 0)
    full = full_parameters(cfg["model"], d, states, source="master")
    for name, p in model.named_parameters():
        assert torch.equal(full[name], p.detach() + 1.0), name
    export(root, tmp_path / "hf", dtype="float32", log=lambda *a, **k: None)
