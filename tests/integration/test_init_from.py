"""model.init_from with real processes: a run trained, exported, imported by a new run that then
loses a rank to SIGKILL and ends bitwise equal to its failure-free twin; a checkpoint that does
not fit the model is refused before any process starts.

What "trains on bitwise the same" means here. A Hugging Face export carries the weights only: no
AdamW moments, no step counter, no data position (transformers' format has no place for them),
so a run from an export cannot equal the uninterrupted run, which keeps its moments and goes on
at step N + 1 with step N + 1's batches and rate. What is compared instead, bitwise:
  1. the import is the trained run's state at step N minus exactly that: every rank's parameter
     buffer built from the export equals the trained run's final buffer (ZeRO pad aside), so a
     job from the export starts where one from the trained buffers with a fresh optimizer at
     step 0 would (a job is a pure function of its initial buffers, seed and config);
  2. training on from it is deterministic through a failure: hot-swapped, it ends bitwise equal
     to its failure-free twin from the same export.
Not compared (not built): a job that resumes the trained run's own checkpoint with its moments
zeroed and its step reset, which would check 1's "pure function" step by running it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from deadpool.export import export
from deadpool.export.hf_import import stage_loader
from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states, load_final_rank
from deadpool.parallel.stage import build_stage
from tests.conftest import compose_train

pytest.importorskip("safetensors")
BASE = ["model=tiny", "parallel=dp2", "parallel.pp=2", "ft.num_spares=1", "log_every_steps=0"]
quiet = lambda *a, **k: None  # noqa: E731


def losses(run_dir) -> dict[int, float]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["loss"] is not None:
            out.setdefault(r["step"], r["loss"])
    return out


@pytest.mark.slow
def test_a_run_from_an_exported_model_hot_swaps_bitwise(tmp_path):
    a = run_job(compose_train(BASE + ["num_steps=6", "faults=none"], tmp_path / "a"), log=quiet)
    assert a["outcome"] == "completed"
    export(tmp_path / "a", tmp_path / "hf", log=quiet)
    # the import of the export is every rank's trained parameter buffer, bit for bit (ZeRO pad
    # aside): a new run starts from exactly the trained weights, with a fresh optimizer
    cfg = compose_train(BASE, tmp_path / "x")
    loader = stage_loader(tmp_path / "hf", cfg["model"])
    for r, (pp, tp) in enumerate([(0, 0), (0, 0), (1, 0), (1, 0)]):  # dp2 x pp2: rank = pp*2 + dp
        stage = build_stage(cfg["model"], 0, pp_rank=pp, pp=2, tp_rank=tp, tp=1, weights=loader)
        flat = torch.cat([p.detach().reshape(-1) for p in stage.parameters()])
        trained = load_final_rank(tmp_path / "a", r)["params"]
        assert torch.equal(trained[:flat.numel()], flat), r
    init = [f"model.init_from={tmp_path / 'hf'}", "num_steps=6"]
    ref = run_job(compose_train(BASE + init + ["faults=none"], tmp_path / "ref"), log=quiet)
    assert ref["outcome"] == "completed" and not ref["recoveries"]
    run = run_job(compose_train(BASE + init + ["faults=kill_mid_step", "faults.events.0.step=3"],
                                tmp_path / "run"), log=quiet)
    assert run["outcome"] == "completed", run["message"]
    (rec,) = run["recoveries"]
    assert rec["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path / "run", tmp_path / "ref")
    assert equal, why
    # the import took effect: the new run's first loss is the trained run's level, not init's
    la, lr = losses(tmp_path / "a"), losses(tmp_path / "ref")
    assert lr[1] < la[1] - 0.05, (la, lr)


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_before_any_process_starts(tmp_path):
    transformers = pytest.importorskip("transformers")
    conf = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=352,
                                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    transformers.LlamaForCausalLM(conf).save_pretrained(str(tmp_path / "hf"))
    p = subprocess.run([sys.executable, "-m", "deadpool.train", "model=tiny",
                        f"model.init_from={tmp_path / 'hf'}", f"hydra.run.dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "num_key_value_heads=2 but the model config has n_kv_heads=4" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "run" / "logs").exists()
