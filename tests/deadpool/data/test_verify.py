"""Data at launch: the launch reads no shard (sizes and the manifest only: seconds for any
corpus); the checksums are verified in the background while the job runs, and a bad shard ends
the job failed with a message naming it."""

from __future__ import annotations

import threading

import pytest

from deadpool.data import check_data, manifest as mf
from deadpool.data.prepare import prepare
from deadpool.data.verify import BackgroundVerify
from deadpool.launch.job import run_job, validate
from tests.conftest import compose_train

quiet = lambda *a, **k: None  # noqa: E731


@pytest.fixture
def prepared(tmp_path):
    docs = tmp_path / "docs.txt"
    docs.write_text("".join(f"Doc {i}: " + "some words here " * (i % 7 + 1) + "\n\n" for i in range(300)))
    out = tmp_path / "tok"
    prepare([docs], out, tokenizer="byte", shard_tokens=2000, val_fraction=0.1,
            documents="paragraph", log=quiet)
    return out


def corrupt(path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 1  # same size: only a checksum sees it
    path.write_bytes(bytes(raw))


def test_launch_reads_no_shard(prepared, tmp_path, monkeypatch):
    calls = []
    real = mf.file_xxh3
    monkeypatch.setattr(mf, "file_xxh3", lambda p, *a, **k: calls.append(p) or real(p, *a, **k))
    cfg = compose_train(["model=tiny", "parallel=dp2", "data=tokens", f"data.path={prepared}",
                         "eval_every_steps=2"], tmp_path / "run")
    validate(cfg)
    assert calls == [], f"launch checksummed {len(calls)} file(s)"
    # the cheap checks still hold: a shard of the wrong size is refused at launch
    shard = prepared / "train_00001.bin"
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(ValueError, match="train_00001.bin is .* bytes, the manifest says"):
        check_data(cfg)


def test_the_background_check_names_a_corrupted_shard(prepared):
    m = mf.read(prepared)
    corrupt(prepared / "train_00002.bin")
    bad, done = [], threading.Event()
    v = BackgroundVerify(prepared, m, lambda why: (bad.append(why), done.set()), quiet).start()
    assert done.wait(30)
    (why,) = bad
    assert "train_00002.bin is corrupted" in why and v.error == why
    assert v.checked == 3  # tokenizer.json, train_00000, train_00001 passed before it


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_corrupted_shard_fails_the_job_naming_it(prepared, tmp_path):
    corrupt(prepared / "val_00000.bin")
    cfg = compose_train(["model=tiny", "parallel=dp2", "num_steps=200", "log_every_steps=0",
                         "data=tokens", f"data.path={prepared}", "ft.num_spares=0",
                         "ft.persist_interval_steps=0"], tmp_path / "run")
    summary = run_job(cfg, log=quiet)
    assert summary["outcome"] == "failed"
    assert "val_00000.bin is corrupted" in summary["message"]
