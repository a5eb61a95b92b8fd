"""Real data through the whole path with real processes: the shipped corpus prepared, trained
dp2 x tp2 x pp2 + 1 warm spare on data=tokens with validation, a rank SIGKILLed mid-step, the
final state bitwise equal to a failure-free run; then the run and its checkpoint exported and
loaded by transformers.LlamaForCausalLM with DeadPool's logits. And an elastic shrink on
data=tokens draws, step by step, the same sequences as the full-width run."""

from __future__ import annotations

import json

import pytest
import torch

from deadpool.data.prepare import prepare
from deadpool.export import export
from deadpool.export.consolidate import full_parameters, load_source
from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states
from deadpool.model import build_model
from tests.conftest import compose_train
from tests.deadpool.data.test_prepare import ROOT

quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    out = tmp_path_factory.mktemp("fables") / "tok"
    prepare([ROOT / "data" / "fables.txt"], out, vocab_size=512, documents="paragraph", log=quiet)
    return out


def base(tokens):
    return ["model=tiny", "parallel=dp2_tp2_pp2", "num_steps=10", "ft.num_spares=1",
            "ft.replication_chunk_mb=0.5", "log_every_steps=0", "data=tokens",
            f"data.path={tokens}", "eval_every_steps=5", "eval_batches=4",
            "ft.persist_interval_steps=10"]


@pytest.mark.slow
@pytest.mark.core
@pytest.mark.timeout(900)
def test_tokens_3d_hot_swap_is_exact_and_the_export_loads_in_transformers(tokens, tmp_path):
    transformers = pytest.importorskip("transformers")
    ref = run_job(compose_train(base(tokens) + ["faults=none"], tmp_path / "ref"), log=quiet)
    assert ref["outcome"] == "completed" and not ref["recoveries"]
    ev = "faults.events=[{rank: 5, step: 6, phase: mid_step, kind: kill}]"
    run = run_job(compose_train(base(tokens) + [ev], tmp_path / "run"), log=quiet)
    assert run["outcome"] == "completed", run["message"]
    (rec,) = run["recoveries"]
    assert rec["failed_rank"] == 5 and rec["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path / "run", tmp_path / "ref")
    assert equal, why
    assert run["final_digest"] == ref["final_digest"]
    assert sorted(run["val_loss"]) == ["10", "5"] and run["val_loss"] == ref["val_loss"]

    # export the run's final/ and its step-10 checkpoint: the same tensors
    export(tmp_path / "run", tmp_path / "hf", log=quiet)
    export(tmp_path / "run" / "checkpoints", tmp_path / "hf_ckpt", log=quiet)
    from safetensors.torch import load_file
    a = load_file(str(tmp_path / "hf" / "model.safetensors"))
    b = load_file(str(tmp_path / "hf_ckpt" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "hf" / "tokenizer.json").exists()

    # logits: transformers vs DeadPool's single-process model holding the trained weights
    cfg, dims, states, _ = load_source(tmp_path / "run")
    model = build_model(cfg["model"], cfg["seed"])
    model.load_state_dict(full_parameters(cfg["model"], dims, states))
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    ids = torch.tensor([tok("Once there was a clever fox named Pip who lived by the river.")
                        ["input_ids"]])
    with torch.no_grad():
        ref_logits, got = model(ids), hf(ids).logits
    assert (got - ref_logits).abs().max().item() < 1e-4


def step_batches(run_dir) -> dict[int, dict[str, int]]:
    """Per step, the batch index -> input digest map of the generation that completed it (a
    recomputed step's later records replace the earlier)."""
    out: dict[int, dict[str, int]] = {}
    gen: dict[int, int] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if gen.get(r["step"], -1) < r["generation"]:
            gen[r["step"]], out[r["step"]] = r["generation"], {}
        if gen[r["step"]] == r["generation"]:
            out[r["step"]].update(r["batch_digests"])
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_an_elastic_shrink_keeps_the_sequences_of_every_step(tokens, tmp_path):
    common = ["model=tiny", "parallel=dp4", "num_steps=12", "log_every_steps=0",
              "ft.persist_interval_steps=0", "data=tokens", f"data.path={tokens}"]
    ref = run_job(compose_train(common + ["faults=none"], tmp_path / "ref"), log=quiet)
    assert ref["outcome"] == "completed"
    run = run_job(compose_train(common + ["ft=elastic", "faults=kill_mid_step",
                                          "faults.events.0.step=5"], tmp_path / "run"), log=quiet)
    assert run["outcome"] == "completed", run["message"]
    (rec,) = run["recoveries"]
    assert rec["outcome"] == "shrunk to dp=3"
    got, want = step_batches(tmp_path / "run"), step_batches(tmp_path / "ref")
    assert sorted(want) == list(range(1, 13)) and all(len(b) == 4 for b in want.values())
    assert got == want
    # and the shrunk generation did compute some step with a rank drawing two batches
    late = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(len(r["batch_digests"]) == 2 for r in late if r["step"] > rec["resume_step"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_megatron_data_hot_swap_is_exact(tokens, tmp_path):
    """data=megatron (the shipped corpus's tokens written as a Megatron-LM indexed dataset):
    a rank SIGKILLed mid-step, its spare ends bitwise equal to the failure-free run."""
    import numpy as np

    from deadpool.data import megatron
    from deadpool.data.manifest import read

    m = read(tokens)
    stream = np.concatenate([np.fromfile(tokens / s["file"], dtype="<u2")
                             for s in m["splits"]["train"]["shards"]])
    cuts = np.flatnonzero(stream == m["eos_id"]) + 1
    megatron.write(tmp_path / "fables", [d for d in np.split(stream, cuts) if d.size])
    common = ["model=tiny", "parallel=dp2", "num_steps=8", "ft.num_spares=1", "log_every_steps=0",
              "ft.persist_interval_steps=0", "data=megatron", f"data.path={tmp_path / 'fables'}"]
    ref = run_job(compose_train(common + ["faults=none"], tmp_path / "ref"), log=quiet)
    assert ref["outcome"] == "completed" and not ref["recoveries"]
    ev = "faults.events=[{rank: 1, step: 4, phase: mid_step, kind: kill}]"
    run = run_job(compose_train(common + [ev], tmp_path / "run"), log=quiet)
    assert run["outcome"] == "completed", run["message"]
    (rec,) = run["recoveries"]
    assert rec["failed_rank"] == 1 and rec["outcome"] == "hot-swapped"
    equal, why = compare_final_states(tmp_path / "run", tmp_path / "ref")
    assert equal, why
