"""python -m deadpool.export --sample: the export, loaded by transformers, continues a prompt with
the tokens DeadPool's own model picks greedily."""

from __future__ import annotations

import json

import pytest
import torch

from deadpool.export.__main__ import main as export_main
from deadpool.export.sample import main as sample_main
from deadpool.topology import ParallelDims
from tests.deadpool.export.test_export import MODEL, trained_like, write_run

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

WORDS = [f"w{i}" for i in range(MODEL["vocab_size"])]


def write_tokenizer(out) -> tokenizers.Tokenizer:
    """A word-level tokenizer over the model's whole vocabulary (id i: "w<i>")."""
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({w: i for i, w in enumerate(WORDS)},
                                                           unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False}))
    return tok


def greedy(model, ids: list[int], n: int) -> list[int]:
    """DeadPool's single-process model, argmax token by token (no cache)."""
    x = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            x = torch.cat([x, model(x)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return x[0, len(ids):].tolist()


def test_sample_prints_deadpools_own_greedy_continuation(tmp_path, capsys):
    model = trained_like(41)
    write_run(tmp_path / "run", model, ParallelDims(1, 2, 2, ranks_per_node=2))
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf")]) == 0
    tok = write_tokenizer(tmp_path / "hf")
    prompt = "w5 w17 w3 w40"
    want = greedy(model, tok.encode(prompt).ids, 12)
    assert len(set(want)) > 2  # not a constant continuation
    capsys.readouterr()
    assert sample_main([str(tmp_path / "hf"), prompt, "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip() == prompt + " " + " ".join(WORDS[i] for i in want)
    # token ids in, token ids out, where the export has no tokenizer
    (tmp_path / "hf" / "tokenizer.json").unlink()
    assert sample_main([str(tmp_path / "hf"), "--ids", "5,17,3,40", "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.split() == [str(i) for i in want]
    assert sample_main([str(tmp_path / "hf"), "some text"]) == 2
    assert "no tokenizer.json" in capsys.readouterr().err


def test_export_with_sample_exports_then_continues(tmp_path, capsys):
    model = trained_like(42)
    write_run(tmp_path / "run", model, ParallelDims(1, 1, 1))
    assert export_main([str(tmp_path / "run"), str(tmp_path / "hf"), "--sample", "x"]) == 2
    assert (tmp_path / "hf" / "model.safetensors").exists()  # exported, then no tokenizer
    assert "no tokenizer.json" in capsys.readouterr().err
