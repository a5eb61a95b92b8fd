"""MFU and tokens/s/GPU (deadpool/rank/mfu.py): the FLOPs formula against the built model, the peak
table, and the fields in the metrics, the progress line and TensorBoard of a real trainer."""

from __future__ import annotations

import json

import pytest

from deadpool.model import build_model, model_config
from deadpool.rank import mfu

LLAMA3_8B = dict(vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                 ffn_mult=5, ffn_multiple_of=1024, max_seq_len=8192)  # conf/model/llama3_8b


@pytest.mark.parametrize("cfg", [dict(vocab_size=512, d_model=128, n_layers=2, n_heads=4,
                                      n_kv_heads=2, ffn_mult=4, max_seq_len=64)])
def test_flops_per_token_counts_the_built_model_without_its_embedding(cfg):
    model = build_model(cfg, 0)
    n = sum(p.numel() for name, p in model.named_parameters() if name != "embed.weight")
    assert mfu.params_without_embedding(cfg) == n
    c = model_config(cfg)
    assert mfu.flops_per_token(cfg, 64) == 6 * n + 12 * c.n_layers * c.d_model * 64


def test_llama3_8b_flops_per_token_is_torchtitans():
    # Llama 3 8B: 8.03e9 parameters, 0.525e9 of them the input embedding; torchtitan's
    # get_num_flop_per_token at seq 8192: 6 * 7.50e9 + 12 * 32 * 4096 * 8192 = 5.79e10
    cfg = model_config(LLAMA3_8B)
    assert cfg.ffn_hidden == 14336
    n = mfu.params_without_embedding(cfg)
    assert n + 128256 * 4096 == pytest.approx(8.03e9, rel=1e-3)
    assert mfu.flops_per_token(cfg, 8192) == pytest.approx(5.79e10, rel=1e-3)


def test_peak_table_and_setting():
    assert mfu.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert mfu.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert mfu.peak_tflops("NVIDIA H200") == 989.0
    assert mfu.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert mfu.peak_tflops("Tesla T4") is None and mfu.peak_tflops(None) is None
    assert mfu.device_peak_flops({"device": "cpu"}) is None  # CPU: MFU omitted
    assert mfu.device_peak_flops({"device": "cpu", "metrics": {"peak_tflops": 2}}) == 2e12


def test_the_metrics_progress_line_and_tensorboard_carry_throughput_and_mfu(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.deadpool.test_trainer import STEPS, trainer

    tr, comm = trainer(tmp_path, extra=["metrics.peak_tflops=0.5", "log_every_steps=3",
                                        "logging.tensorboard=true"])
    tr.train(comm)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    fpt = mfu.flops_per_token(tr.cfg["model"], tr.cfg["seq_len"])
    for r in rows:  # dp=1, one rank: the batch's tokens over the step time
        assert r["tokens_per_s_per_gpu"] == pytest.approx(8 * 64 / r["step_time_s"])
        assert r["mfu"] == pytest.approx(r["tokens_per_s_per_gpu"] * fpt / 0.5e12)
    lines = [x for x in capsys.readouterr().out.splitlines() if "/6  loss" in x]
    assert len(lines) == 2  # steps 3 and 6
    last = rows[-1]
    assert f"loss[dp0] {last['loss']:.4f}" in lines[-1]  # labelled: one data-parallel rank's
    assert f"MFU {last['mfu']:.3f}" in lines[-1] and "tok/s/GPU" in lines[-1]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    mfus = acc.Scalars("perf/mfu")
    assert [e.step for e in mfus] == list(range(1, STEPS + 1))
    assert mfus[-1].value == pytest.approx(last["mfu"], rel=1e-6)
    assert "perf/tokens_per_s_per_gpu" in acc.Tags()["scalars"]
