"""Retention of disk checkpoints: keep the newest ``ft.keep_checkpoints`` complete steps.

Every periodic checkpoint is a new ``step_<S>`` directory; without retention a long job fills its
file system. After a step becomes complete, the writer that completed it removes the complete
steps older than the newest ``keep`` (``prune``). The rules:

    keep the newest ``keep`` complete steps      (by step number; 0 or None: keep everything)
    never remove the only complete step          (``keep`` is at least 1 when it removes at all)
    never remove an incomplete step              (it may be being written now; a newer complete
                                                  one shadows it, and a rewrite replaces it whole)
    never remove ``protect``                     (the step its caller just wrote)

Removal moves the directory aside under a hidden name first (one atomic rename: a reader sees it
whole or not at all, and ``files.latest_step_dir`` never returns it half-deleted), then deletes
it. Several ranks may prune at once: each rename succeeds for one of them.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from deadpool.checkpoint.files import _complete_steps


def prune(root, keep: int | None, protect: int | None = None) -> list[int]:
    """Remove the complete steps under ``root`` older than its newest ``keep`` complete ones;
    returns the steps removed."""
    if not keep or int(keep) < 1:
        return []
    steps = _complete_steps(Path(root))
    removed = []
    for step, path in steps[:-int(keep)]:
        if step == protect:
            continue
        aside = path.with_name(f".{path.name}.pruned-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            os.rename(path, aside)
        except OSError:  # another rank's prune got there first
            continue
        shutil.rmtree(aside, ignore_errors=True)
        removed.append(step)
    return removed
