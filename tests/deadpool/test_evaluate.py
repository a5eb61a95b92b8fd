"""Validation loss (deadpool/rank/evaluate.py) in the training loop of one rank, in-process: recorded,
equal to the single-process model's on the held-out batches, and without effect on the state."""

from __future__ import annotations

import json

import pytest
import torch

from tests.deadpool.test_trainer import trainer


@pytest.fixture(scope="module")
def fables(tmp_path_factory):
    """The shipped corpus, prepared (byte tokens fit the tiny model's vocabulary)."""
    from deadpool.data.prepare import prepare
    from tests.deadpool.data.test_prepare import ROOT

    out = tmp_path_factory.mktemp("fables") / "tok"
    prepare([ROOT / "data" / "fables.txt"], out, tokenizer="byte", documents="paragraph",
            log=lambda *a: None)
    return out


def test_evaluation_does_not_change_the_final_state(tmp_path, fables):
    data = ["data=tokens", f"data.path={fables}"]
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    off, comm = trainer(tmp_path / "off", extra=data)
    off.train(comm)
    on, comm = trainer(tmp_path / "on", extra=[*data, "eval_every_steps=2", "eval_batches=3"])
    on.train(comm)
    assert on.digest() == off.digest()
    rows = [json.loads(line) for line in (tmp_path / "on" / "m.jsonl").read_text().splitlines()]
    vals = {r["step"]: r["val_loss"] for r in rows if r["val_loss"] is not None}
    assert sorted(vals) == [2, 4, 6] and all(2.0 < v < 7.0 for v in vals.values())
    # the mean over the three held-out batches, recomputed here with the single-process model
    from deadpool.model import build_model
    model = build_model(on.cfg["model"], on.cfg["seed"])
    with torch.no_grad():
        for p, q in zip(model.parameters(), on.stage.parameters()):
            p.copy_(q)
        ref = sum(float(model(*on.corpus.eval_batch(k, on.cfg["batch_size"], on.cfg["seq_len"])))
                  for k in range(3)) / 3
    assert abs(vals[6] - ref) < 1e-5

