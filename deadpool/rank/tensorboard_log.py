"""TensorBoard event files (``logging.tensorboard=true``): ``run_dir/tensorboard/``.

Fed the per-step metrics record (``Trainer.record_metrics``) of the job's reporting rank (the
last pipeline stage's data-parallel rank 0, tensor-parallel rank 0: the one that prints
progress), whichever process holds that rank: after a hot swap the spare's process writes on
into the same directory (its own file; TensorBoard merges the files of a directory). The
coordinator adds each recovery as it completes (``RecoveryBoard``, fed by
``recovery.timeline.RecoveryLog``): scalars at its resume step and a text entry with its
breakdown; ``write_recoveries`` at the end adds those it had not logged. ``torch.utils.
tensorboard`` (the ``tensorboard`` package) is imported only when logging is on.

    train/loss            the reporting rank's loss (its data-parallel batch's mean; summary.json's
                          final loss is the mean over data-parallel ranks)
    val/loss              validation loss (all eval batches; eval_every_steps)
    train/lr, train/grad_norm          when the record has them
    perf/step_time_s, perf/tokens_per_s   tokens of the global batch / step time
    perf/tokens_per_s_per_gpu, perf/mfu   the same over the job's GPUs, and its model FLOPs
                          utilisation (deadpool/rank/mfu.py; MFU only where the device's peak is known)
    snapshot/interval_steps, snapshot/protection_lag_steps, snapshot/blocked_s
    recovery/<phase>_s    per recovery, at its resume step; text ``recovery/generation_<g>``
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

SCALARS = {"loss": "train/loss", "val_loss": "val/loss", "lr": "train/lr",
           "grad_norm": "train/grad_norm", "step_time_s": "perf/step_time_s",
           "snapshot_interval": "snapshot/interval_steps",
           "protection_lag_steps": "snapshot/protection_lag_steps",
           "snapshot_blocked_s": "snapshot/blocked_s", "checkpoint_s": "checkpoint/critical_path_s",
           "tokens_per_s_per_gpu": "perf/tokens_per_s_per_gpu", "mfu": "perf/mfu"}
RECOVERY_TIMES = ("detect_s", "plan_s", "rebuild_s", "transfer_s", "rollback_s", "load_s",
                  "build_s", "first_step_s", "kill_to_training_s", "kill_to_first_step_s")


def log_dir(cfg: dict) -> Path:
    return Path(cfg["run_dir"]) / "tensorboard"


def _writer(directory: Path, suffix: str):
    from torch.utils.tensorboard import SummaryWriter
    return SummaryWriter(log_dir=str(directory), filename_suffix=suffix)


class Board:
    def __init__(self, cfg: dict, slot: int):
        self.dir, self.slot, self.w = log_dir(cfg), slot, None
        p = cfg["parallel"]
        self.tokens_per_step = (int(p.get("global_dp") or p["dp"]) * int(cfg["batch_size"])
                                * int(cfg["seq_len"]))

    def write(self, rec: dict, reporter: bool) -> None:
        """Log one metrics record if this rank is the reporting one. Flushed at once: workers
        leave with ``os._exit``, without destructors."""
        if not reporter:
            return
        if self.w is None:
            self.w = _writer(self.dir, f".slot{self.slot}")
        step = int(rec["step"])
        for key, tag in SCALARS.items():
            if rec.get(key) is not None:
                self.w.add_scalar(tag, float(rec[key]), step)
        if rec.get("step_time_s"):
            self.w.add_scalar("perf/tokens_per_s", self.tokens_per_step / rec["step_time_s"], step)
        self.w.flush()


class Off:
    def write(self, rec: dict, reporter: bool) -> None:
        pass


def check(cfg: dict) -> None:
    """``logging.tensorboard=true`` needs ``torch.utils.tensorboard`` (the tensorboard package):
    refused before any process starts, not in every worker at its first step."""
    if (cfg.get("logging") or {}).get("tensorboard"):
        try:
            importlib.import_module("torch.utils.tensorboard")
        except ImportError as e:
            raise ValueError(f"logging.tensorboard=true needs the tensorboard package ({e}); "
                             "pip install tensorboard") from None


def board(cfg: dict, slot: int):
    """A ``Board`` when ``logging.tensorboard`` is on, else a no-op with the same method."""
    return Board(cfg, slot) if (cfg.get("logging") or {}).get("tensorboard") else Off()


RECOVERIES_FILE = "recoveries.jsonl"  # run_dir/: each record as completed (recovery.timeline)


def _same(rec: dict) -> str:
    return json.dumps(rec, sort_keys=True, default=str)


def _add_recovery(w, rec: dict) -> None:
    step = int(rec.get("resume_step") or 0)
    for key in RECOVERY_TIMES:
        if isinstance(rec.get(key), (int, float)):
            w.add_scalar(f"recovery/{key}", float(rec[key]), step)
    w.add_text(f"recovery/generation_{rec['generation']}",
               "    " + json.dumps(rec, indent=1, default=str).replace("\n", "\n    "), step)


class RecoveryBoard:
    """The coordinator's TensorBoard file of recoveries: each record added as it completes
    (``recovery.timeline.RecoveryLog``) and flushed at once, so a crash keeps it."""

    def __init__(self, cfg: dict):
        self.dir, self.w = log_dir(cfg), None

    def add(self, rec: dict) -> None:
        if self.w is None:
            self.w = _writer(self.dir, ".recoveries")
        _add_recovery(self.w, rec)
        self.w.flush()


def recovery_board(cfg: dict) -> RecoveryBoard | None:
    return RecoveryBoard(cfg) if (cfg.get("logging") or {}).get("tensorboard") else None


def write_recoveries(cfg: dict, summary: dict) -> None:
    """Each recovery of ``summary`` (summary.json's records) as TensorBoard entries, except those
    the coordinator already logged as they completed (the lines of ``recoveries.jsonl``)."""
    if not (cfg.get("logging") or {}).get("tensorboard") or not summary["recoveries"]:
        return
    logged = Path(cfg["run_dir"]) / RECOVERIES_FILE
    seen = set()
    if logged.exists():
        seen = {_same(json.loads(x)) for x in logged.read_text().splitlines() if x.strip()}
    todo = [rec for rec in summary["recoveries"] if _same(rec) not in seen]
    if not todo:
        return
    w = _writer(log_dir(cfg), ".recoveries")
    for rec in todo:
        _add_recovery(w, rec)
    w.close()
