"""Disk checkpoints with torch.distributed.checkpoint (DCP).

Used for the cases in-memory replicas cannot cover: periodic persistence (``ft.persist_interval_
steps``, written off the training thread by ``AsyncPersister``), the final checkpoint when a rank
dies and no spare is left, the coordinator's loss, and ``ft.resume_from``.

    files.py       the layout on disk (``step_<S>/rank_<r>/``, meta.json, header.json written
                   last), atomic installs, discovery of the newest complete step, RNG encoding
    dcp_io.py      one rank's state to and from a DCP directory, nothing arbitrary unpickled
    persister.py   ``AsyncPersister``: periodic checkpoints written off the training thread
    rank_state.py  every disk write and read of a running rank's state (the runtime's only
                   caller of the three above)
    unique.py      what a rank writes: a data-parallel group's replicated tensors once (or,
                   spread, a 1/dp part each), and a rank's whole state read back
    retention.py   ``ft.keep_checkpoints``: the newest complete steps kept, older ones removed
    relayout.py    a rank's state from a checkpoint written at another dp x tp x pp
    final.py       the end of a job: its final state as one unique-state checkpoint (its
                   shared tensors spread over the replicas), a wait on the writers' progress,
                   the final digest
"""

from deadpool.checkpoint.dcp_io import load_rank_state, read_rank_state, save_rank_state
from deadpool.checkpoint.files import (HEADER_FILE, META_FILE, CheckpointWriteError,
                                       decode_rng_state, encode_rng_state, is_complete,
                                       latest_complete_step, latest_step_dir, rank_complete,
                                       rank_dir, read_header, read_meta, resolve_resume,
                                       write_meta)
from deadpool.checkpoint.persister import AsyncPersister

__all__ = ["AsyncPersister", "CheckpointWriteError", "HEADER_FILE", "META_FILE",
           "decode_rng_state", "encode_rng_state", "is_complete", "latest_complete_step",
           "latest_step_dir", "load_rank_state", "rank_complete", "rank_dir", "read_header",
           "read_meta", "read_rank_state", "resolve_resume", "save_rank_state", "write_meta"]
