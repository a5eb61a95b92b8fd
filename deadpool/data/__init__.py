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
    megatron.py   MegatronDataset: Megatron-LM's indexed datasets (PREFIX.bin/.idx), same order
    prepare.py    ``python -m deadpool.data.prepare``: text -> tokenizer + shards + manifest
    corpus.py     prepare's readers: plain text, JSONL, Parquet
    encode.py     prepare's encoding, over files in parallel (``--workers``)
    tokenizer.py  the byte and BPE tokenizers prepare writes, or a user's tokenizer.json
    manifest.py   the prepared directory's manifest, and its checks (checksums, sizes)
    verify.py     the checksums, verified in the background while the job runs
    order.py      the stateless seeded permutation of sample indices (one per epoch)
    fables.py     the generator of the shipped corpus, ``data/fables.txt``
"""

from __future__ import annotations

from pathlib import Path



def __getattr__(name: str):
    # lazily: prepare's worker processes import this package and must not pay for torch
    if name == "SyntheticCorpus":
        from deadpool.data.synthetic import SyntheticCorpus
        return SyntheticCorpus
    raise AttributeError(name)


__all__ = ["SyntheticCorpus", "build_data", "check_data", "global_batches", "start_verify"]
SOURCES = ("synthetic", "tokens", "megatron")


def global_batches(cfg: dict) -> int:
    """Batches in a step's global batch: ``parallel.global_dp`` (an elastic job keeps its
    original width there), else ``parallel.dp``."""
    p = cfg["parallel"]
    return int(p.get("global_dp") or p["dp"])


def build_data(cfg: dict):
    """The data source ``cfg["data"]`` names (``synthetic`` when the group is absent)."""
    data = cfg.get("data") or {"name": "synthetic"}
    if data["name"] == "synthetic":
        from deadpool.data.synthetic import SyntheticCorpus
        return SyntheticCorpus(cfg["model"]["vocab_size"], cfg["seed"])
    if data["name"] == "tokens":
        from deadpool.data.tokens import TokenDataset
        return TokenDataset(data["path"], seed=int(cfg["seed"]), seq_len=int(cfg["seq_len"]),
                            batch_size=int(cfg["batch_size"]), global_batches=global_batches(cfg))
    if data["name"] == "megatron":
        from deadpool.data.megatron import MegatronDataset
        return MegatronDataset(data["path"], seed=int(cfg["seed"]), seq_len=int(cfg["seq_len"]),
                               batch_size=int(cfg["batch_size"]), global_batches=global_batches(cfg),
                               val_path=data.get("val_path"))
    raise ValueError(f"data.name must be one of {', '.join(SOURCES)}, got {data['name']!r}")


def check_data(cfg: dict) -> None:
    """Refuse, before any process starts, data the job cannot train on: raises ``ValueError``
    naming the field (a missing shard or index, a size that disagrees, a tokenizer larger than
    the model's vocabulary, a split too short for one sequence). Reads no shard's bytes: the
    checksums are ``start_verify``'s. Makes ``data.path`` (and ``data.val_path``) absolute in
    ``cfg``: processes started elsewhere (srun) and a later export read it from job.json."""
    data = cfg.get("data") or {"name": "synthetic"}
    if data["name"] == "synthetic":
        return
    if data["name"] not in SOURCES:
        raise ValueError(f"data.name must be one of {', '.join(SOURCES)}, got {data['name']!r}")
    for key in ("path", "val_path"):
        if data.get(key) not in (None, "", "???"):
            data[key] = str(Path(data[key]).resolve())
    need_val = bool(int(cfg.get("eval_every_steps") or 0))
    if data["name"] == "megatron":
        from deadpool.data import megatron
        megatron.check(data.get("path"), vocab_size=int(cfg["model"]["vocab_size"]),
                       seq_len=int(cfg["seq_len"]), need_val=need_val, val_path=data.get("val_path"))
        return
    from deadpool.data.tokens import check
    check(data.get("path"), vocab_size=int(cfg["model"]["vocab_size"]), seq_len=int(cfg["seq_len"]),
          need_val=need_val)


def start_verify(cfg: dict, on_bad, log=print):
    """``data=tokens``: every file's checksum on a background thread of the launching process
    (``verify.BackgroundVerify``, started); ``data=megatron``: the token ids of a prefix too large
    for launch to read, against ``model.vocab_size`` (``verify.BackgroundIds``); else None."""
    data = cfg.get("data") or {"name": "synthetic"}
    if data["name"] == "megatron":
        return _start_id_check(cfg, data, on_bad, log)
    if data["name"] != "tokens":
        return None
    from deadpool.data import manifest as mf
    from deadpool.data.verify import BackgroundVerify
    return BackgroundVerify(data["path"], mf.read(data["path"]), on_bad, log).start()


def _start_id_check(cfg: dict, data: dict, on_bad, log):
    from deadpool.data import megatron
    from deadpool.data.verify import BackgroundIds
    vocab = int(cfg["model"]["vocab_size"])
    todo = {}
    for field in ("path", "val_path"):
        if data.get(field) not in (None, "", "???"):
            index = megatron.read_index(data[field], f"data.{field}")
            if not megatron.ids_fit(index.dtype, vocab) and \
                    index.bin.stat().st_size > megatron.SCAN_AT_LAUNCH_BYTES:
                todo[f"data.{field}"] = data[field]
    return BackgroundIds(todo, vocab, on_bad, log).start() if todo else None
