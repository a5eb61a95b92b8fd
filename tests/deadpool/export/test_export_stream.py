"""Export reads tensor by tensor: the memory it takes is bounded by the largest tensor, not the
model, and safetensors' own reader loads what it wrote (the logits tests in test_export.py and
the bitwise import round trip in test_hf_import.py run through the same writer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import deadpool
from deadpool.export import export
from deadpool.export.safetensors_io import write_stream
from deadpool.topology import ParallelDims
from tests.deadpool.export.test_export import quiet, rank_states

safetensors_torch = pytest.importorskip("safetensors.torch")

# ~19 M parameters (76 MB fp32); the largest tensor, a layer's qkv, 3 x 512 x 512 (3.1 MB)
BIG = {"vocab_size": 96, "d_model": 512, "n_layers": 6, "n_heads": 8, "ffn_mult": 4,
       "max_seq_len": 32}

# the child exports a small run first (one-time costs: lazy imports, allocator pools), then
# samples its anonymous resident memory (RssAnon: not the memory-mapped rank files, which the
# kernel may drop) while it exports the big one, and prints the peak growth in bytes
CHILD = r"""
import sys, threading, time
from deadpool.export import export
export(sys.argv[3], sys.argv[4], log=lambda *a: None)

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024

peak, base, stop = [0], anon(), threading.Event()
def sample():
    while not stop.is_set():
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)
t = threading.Thread(target=sample); t.start()
export(sys.argv[1], sys.argv[2], log=lambda *a: None)
stop.set(); t.join()
print(max(peak[0], anon()) - base)
"""


@pytest.mark.slow  # ~20 s on 2 busy cores: a 76 MB model written, exported in a child
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc (Linux)")
def test_export_memory_is_bounded_by_the_largest_tensor_not_the_model(tmp_path):
    torch.manual_seed(0)
    from deadpool.model import GPT, model_config
    from tests.deadpool.export.test_export import trained_like, write_run

    with torch.no_grad():
        model = GPT(model_config(BIG))
    dims = ParallelDims(1, 2, 2, ranks_per_node=2)
    write_run(tmp_path / "small", trained_like(1), dims)
    (tmp_path / "run" / "final").mkdir(parents=True)
    for r, st in rank_states(model, dims, BIG).items():
        torch.save(st, tmp_path / "run" / "final" / f"rank{r}.pt")
    (tmp_path / "run" / "job.json").write_text(json.dumps(
        {"model": BIG, "seed": 0, "parallel": {"dp": 1, "tp": 2, "pp": 2}, "data": {"name": "synthetic"}}))
    total = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    del model
    root = Path(deadpool.__file__).resolve().parents[1]
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
           "PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "run"), str(tmp_path / "hf"),
                        str(tmp_path / "small"), str(tmp_path / "hf_small")],
                       capture_output=True, text=True, timeout=300, cwd=root, env=env)
    assert p.returncode == 0, p.stderr
    grew = int(p.stdout.split()[-1])
    assert total > 70e6 and largest < 3.2e6
    # a full parameter, its index and scatter buffers, the converted copy: a few largest tensors
    assert grew < 8 * largest, f"export grew by {grew / 1e6:.1f} MB for a {total / 1e6:.0f} MB model"
    out = safetensors_torch.load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert sum(t.numel() * 4 for t in out.values()) == total


def test_streamed_files_load_as_the_tensors_written(tmp_path):
    """``write_stream``'s files, one or sharded with an index, load with safetensors' own reader
    as the tensors written (fp32 and bf16); a tensor out of plan is refused."""
    g = torch.Generator().manual_seed(0)
    tensors = {"b.weight": torch.randn(7, 3, generator=g), "a.weight": torch.randn(5, generator=g),
               "c.weight": torch.randn(4, 4, generator=g).to(torch.bfloat16)}
    plan = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    (tmp_path / "one").mkdir()
    assert write_stream(plan, iter(tensors.items()), tmp_path / "one", 10**9) == ["model.safetensors"]
    got = safetensors_torch.load_file(str(tmp_path / "one" / "model.safetensors"))
    assert set(got) == set(tensors) and all(torch.equal(got[n], t) and got[n].dtype == t.dtype
                                            for n, t in tensors.items())
    (tmp_path / "many").mkdir()
    files = write_stream(plan, iter(tensors.items()), tmp_path / "many", 40)
    assert len(files) == 3
    index = json.loads((tmp_path / "many" / "model.safetensors.index.json").read_text())
    for n, t in tensors.items():
        part = safetensors_torch.load_file(str(tmp_path / "many" / index["weight_map"][n]))
        assert torch.equal(part[n], t)
    with pytest.raises(ValueError, match="arrived where the plan has"):
        write_stream(plan, iter(reversed(list(tensors.items()))), tmp_path / "one", 10**9)


def test_a_checkpoint_is_read_one_pipeline_stage_at_a_time(tmp_path, monkeypatch):
    """From a DCP checkpoint, at most one stage's ranks are in memory at once."""
    from deadpool import checkpoint
    from deadpool.export import consolidate
    from tests.deadpool.export.test_export import MODEL, trained_like

    model = trained_like(31)
    dims = ParallelDims(2, 2, 2, ranks_per_node=2)
    root = tmp_path / "run" / "checkpoints"
    for r, st in rank_states(model, dims).items():
        checkpoint.save_rank_state(root, 3, r, st, {"step": 3}, layout=dims.layout, world_size=8)
    checkpoint.write_meta(root, 3, 8, "periodic", layout=dims.layout)
    (tmp_path / "run" / "job.json").write_text(json.dumps(
        {"model": MODEL, "seed": 0, "parallel": dims.layout, "data": {"name": "synthetic"}}))
    held = []
    real = consolidate.StageStates.__missing__

    def spy(self, rank):
        out = real(self, rank)
        held.append(len(self))
        return out
    monkeypatch.setattr(consolidate.StageStates, "__missing__", spy)
    export(root, tmp_path / "hf", log=quiet)
    assert held and max(held) <= dims.dp * dims.tp
