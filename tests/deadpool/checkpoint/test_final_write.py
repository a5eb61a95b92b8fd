"""A rank's final write (issue 37, the end of a job): ``Worker.write_final`` bumps its progress
while it writes (so the coordinator's wait, ``recovery.finish``, sees a slow disk progressing),
writes the state bitwise, and never leaves a partial file under the final name."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from deadpool.checkpoint import final
from deadpool.protocol import Keys
from deadpool.watchdog import Progress
from deadpool.worker import Worker


def fake_worker(tmp_path, state: dict[str, torch.Tensor]):
    """What ``Worker.write_final`` reads of a worker and its trainer."""
    records = {}
    engine = SimpleNamespace(persister=None, layout=SimpleNamespace(nbytes=sum(
        t.numel() * t.element_size() for t in state.values())), replicated_bytes=0)
    trainer = SimpleNamespace(engine=engine, step=7, params=[state["w"]],
                              state_dict=lambda: state, digest=lambda: "digest-of-rank")
    return SimpleNamespace(trainer=trainer, run_dir=tmp_path, progress=Progress(), slot=3,
                           _set_sealed=lambda k, v: records.__setitem__(k, v)), records


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    flat = torch.randn(64 * 1024, generator=g)
    return {"w": flat[: 32 * 1024].view(128, 256), "exp_avg": flat[32 * 1024:],
            "step": torch.tensor(7)}


def throttled_open(delay_s: float):
    """``open`` whose files take ``delay_s`` per write (a slow shared file system)."""
    class Slow:
        def __init__(self, f):
            self.f = f

        def write(self, b):
            time.sleep(delay_s)
            return self.f.write(b)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def opener(path, mode="r", *a, **k):
        return Slow(open(path, mode, *a, **k))
    return opener


def test_a_slow_final_write_shows_progress_while_it_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(final, "open", throttled_open(0.02), raising=False)
    monkeypatch.setattr(final, "CHUNK_BYTES", 16 * 1024, raising=False)
    w, records = fake_worker(tmp_path, state())
    seen, done = set(), threading.Event()

    def heartbeat():  # what the heartbeat thread publishes, every 10 ms
        while not done.is_set():
            seen.add(w.progress.count)
            time.sleep(0.01)
    beat = threading.Thread(target=heartbeat)
    beat.start()
    try:
        Worker.write_final(w, 2)
    finally:
        done.set()
        beat.join()
    assert len(seen) >= 5, f"the heartbeat saw progress values {sorted(seen)} during the write"
    assert w.progress.phase.startswith("final")
    got = torch.load(tmp_path / "final" / "rank2.pt")
    want = state()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert got["w"].untyped_storage().nbytes() == 32 * 1024 * 4  # its own copy, not the flat buffer
    rec = json.loads(records[Keys.final(2)])
    assert rec["digest"] == "digest-of-rank" and rec["step"] == 7


def test_a_failed_final_write_leaves_no_file_under_the_final_name(tmp_path, monkeypatch):
    def broken_open(path, mode="r", *a, **k):
        f = open(path, mode, *a, **k)

        class Full:
            def write(self, b):
                raise OSError(28, "No space left on device")

            def __getattr__(self, name):
                return getattr(f, name)

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                f.close()
        return Full()
    monkeypatch.setattr(final, "open", broken_open, raising=False)
    w, records = fake_worker(tmp_path, state())
    with pytest.raises(Exception):
        Worker.write_final(w, 0)
    assert not (tmp_path / "final" / "rank0.pt").exists() and not records
