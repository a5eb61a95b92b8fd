"""Training data: a batch is a pure function of (seed, step, global batch index).

That is what makes a recovered run bitwise equal to a failure-free one: a spare that resumes at
step ``s`` draws exactly the batches the dead rank would have drawn, with no loader state to
restore; and an elastic job that computes several batch indices per rank draws the same global
batch at any data-parallel width.

Every source (``data=`` config group) has the same two methods::

    batch(step, index, batch_size, seq_len) -> (inputs, targets)   # training batch ``index``
    eval_batch(k, batch_size, seq_len)      -> (inputs, targets)   # validation batch ``k``

    synthetic.py  SyntheticCorpus: a seeded bigram chain (the default; no files)
    tokens.py     TokenDataset: memory-mapped token shards written by ``prepare``
    prepare.py    ``python -m deadpool.data.prepare``: text -> tokenizer + shards + manifest
    tokenizer.py  the byte and BPE tokenizers prepare writes (Hugging Face ``tokenizers``)
    manifest.py   the prepared directory's manifest, and its checks (checksums, sizes)
    order.py      the stateless seeded permutation of sample indices (one per epoch)
    fables.py     the generator of the shipped corpus, ``data/fables.txt``
"""

from __future__ import annotations

from pathlib import Path

from deadpool.data.synthetic import SyntheticCorpus

__all__ = ["SyntheticCorpus", "build_data", "check_data", "global_batches"]


def global_batches(cfg: dict) -> int:
    """Batches in a step's global batch: ``parallel.global_dp`` (an elastic job keeps its
    original width there), else ``parallel.dp``."""
    p = cfg["parallel"]
    return int(p.get("global_dp") or p["dp"])


def build_data(cfg: dict):
    """The data source ``cfg["data"]`` names (``synthetic`` when the group is absent)."""
    data = cfg.get("data") or {"name": "synthetic"}
    if data["name"] == "synthetic":
        return SyntheticCorpus(cfg["model"]["vocab_size"], cfg["seed"])
    if data["name"] == "tokens":
        from deadpool.data.tokens import TokenDataset
        return TokenDataset(data["path"], seed=int(cfg["seed"]), seq_len=int(cfg["seq_len"]),
                            batch_size=int(cfg["batch_size"]), global_batches=global_batches(cfg))
    raise ValueError(f"data.name must be synthetic or tokens, got {data['name']!r}")


def check_data(cfg: dict) -> None:
    """Refuse, before any process starts, data the job cannot train on: raises ``ValueError``
    naming the field (a missing or corrupted shard, a tokenizer larger than the model's
    vocabulary, a split too short for one sequence). Makes ``data.path`` absolute in ``cfg``:
    processes started elsewhere (srun) and a later export read it from job.json."""
    data = cfg.get("data") or {"name": "synthetic"}
    if data["name"] == "synthetic":
        return
    if data["name"] != "tokens":
        raise ValueError(f"data.name must be synthetic or tokens, got {data['name']!r}")
    from deadpool.data.tokens import check
    if data.get("path") not in (None, "", "???"):
        data["path"] = str(Path(data["path"]).resolve())
    check(data.get("path"), vocab_size=int(cfg["model"]["vocab_size"]), seq_len=int(cfg["seq_len"]),
          need_val=bool(int(cfg.get("eval_every_steps") or 0)))
