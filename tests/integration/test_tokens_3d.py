"""Real data through the whole path with real processes: the shipped corpus prepared, trained
dp2 x tp2 x pp2 + 1 warm spare on data=tokens with validation, a rank SIGKILLed mid-step, the
final state bitwise equal to a failure-free run; then the run and its checkpoint exported and
loaded by transformers.LlamaForCausalLM with DeadPool's logits."""

from __future__ import annotations

import pytest
import torch

from deadpool.data.prepare import prepare
from deadpool.export import export
from deadpool.export.consolidate import full_parameters, load_source
from deadpool.job import run_job
from deadpool.model import build_model
from deadpool.report import compare_final_states
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
