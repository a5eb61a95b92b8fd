"""TensorBoard event files (deadpool/rank/tensorboard_log.py) from the training loop of one rank,
read back with TensorBoard's own reader."""

from __future__ import annotations

import json

import pytest

from tests.deadpool.test_trainer import STEPS, trainer


def test_tensorboard_event_files_hold_the_step_metrics_and_recoveries(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from deadpool.rank import tensorboard_log

    tr, comm = trainer(tmp_path, extra=["logging.tensorboard=true", "eval_every_steps=3"])
    tr.train(comm)
    summary = {"recoveries": [{"generation": 1, "resume_step": 4, "detect_s": 0.05,
                               "transfer_s": 0.02, "outcome": "hot-swapped"}]}
    tensorboard_log.write_recoveries(tr.cfg, summary)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]  # (protection lag needs replication, not started here)
    assert {"train/loss", "val/loss", "perf/step_time_s", "perf/tokens_per_s",
            "snapshot/interval_steps",
            "recovery/detect_s"} <= set(tags)
    # every metric the records carry (lr and grad_norm where the trainer logs them) is a scalar
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    carried = {k for r in rows for k, v in r.items() if v is not None and k in tensorboard_log.SCALARS}
    assert {tensorboard_log.SCALARS[k] for k in carried} <= set(tags)
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, STEPS + 1))
    assert [e.step for e in acc.Scalars("val/loss")] == [3, 6]
    assert acc.Scalars("recovery/detect_s")[0].value == pytest.approx(0.05)
    tokens = 8 * 64  # one batch of batch_size x seq_len per step at dp=1
    first = acc.Scalars("perf/tokens_per_s")[0].value * acc.Scalars("perf/step_time_s")[0].value
    assert first == pytest.approx(tokens, rel=1e-4)
    assert "recovery/generation_1/text_summary" in acc.Tags()["tensors"]



def test_without_the_tensorboard_package_the_job_is_refused_before_it_starts(tmp_path, monkeypatch):
    import sys

    from deadpool.launch.job import validate
    from tests.conftest import compose_train

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import raises ImportError
    cfg = compose_train(["logging.tensorboard=true", "parallel=dp2"], tmp_path)
    with pytest.raises(ValueError, match="needs the tensorboard package"):
        validate(cfg)
    validate(compose_train(["parallel=dp2"], tmp_path))  # off: not needed
