"""The run directory holds one run: a second run never merges its outputs into another's.

A job appends to its per-process metrics and logs (a relaunch inside one job, or a requeued
job resuming, continues the same run), so a directory that already holds another run's outputs
would mix two runs: validation losses of both, metrics appended, a summary over both. Before
anything starts, ``check`` decides::

    run_dir holds no outputs                  the run starts
    overwrite_run_dir=true                    the earlier outputs (and checkpoints in
                                              ft.checkpoint_dir) are removed: a fresh run
    ft.resume_from=auto, a complete           the run continues there (a stopped, preempted or
      checkpoint under ft.checkpoint_dir        requeued job: the same run)
    ft.resume_from=auto, none                 the earlier attempt left nothing to resume from:
                                              its outputs are removed and the run starts afresh
    ft.resume_from inside this run directory  the run continues from it
      or ft.checkpoint_dir
    otherwise                                 refused (ValueError), naming both ways on

Outputs are what a job writes (``job.json``, ``summary.json``, ``metrics.jsonl``, ``metrics/``,
``logs/``, ``final/``, ``tensorboard/``, ``recoveries.jsonl``, the failure-free reference run's
directory) and step directories under ``ft.checkpoint_dir``; anything else there (Hydra's
``.hydra/``) is left alone.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from deadpool import checkpoint

OUTPUTS = ("job.json", "summary.json", "metrics.jsonl", "metrics", "logs", "final", "tensorboard",
           "recoveries.jsonl", "reference_failure_free")


def _holds(p: Path) -> bool:
    if p.is_dir():
        return any(p.iterdir())
    return p.exists()


def previous_outputs(cfg: dict) -> list[Path]:
    """What an earlier run left in ``run_dir`` and ``ft.checkpoint_dir`` (its step directories)."""
    run_dir, ckpt = Path(cfg["run_dir"]), Path(cfg["ft"]["checkpoint_dir"])
    found = [run_dir / name for name in OUTPUTS if _holds(run_dir / name)]
    if ckpt.is_dir():
        found += sorted(p for p in ckpt.iterdir() if p.name.startswith("step_"))
    return found


def _inside(path, roots) -> bool:
    p = Path(path).resolve()
    return any(p == Path(r).resolve() or Path(r).resolve() in p.parents for r in roots)


def check(cfg: dict, log=print) -> tuple[dict, list[Path]]:
    """Decide how the run treats what its directory holds (the module's table). Returns the
    config to run (``ft.resume_from=auto`` resolved to a fresh start where the earlier outputs
    go) and the paths to ``clear`` once the config is known to be valid; raises ``ValueError``
    for a directory holding another run's outputs."""
    found = previous_outputs(cfg)
    if not found:
        return cfg, []
    ft, run_dir = cfg["ft"], Path(cfg["run_dir"])
    resume = ft.get("resume_from")
    mine = (run_dir, ft["checkpoint_dir"])
    if cfg.get("overwrite_run_dir"):
        if resume not in (None, "auto") and _inside(resume, mine):
            raise ValueError(f"overwrite_run_dir=true would remove ft.resume_from={resume}: "
                             "resume from it, or start afresh without it")
        log(f"[deadpool] overwrite_run_dir=true: removing the earlier run's outputs in {run_dir}")
        return (dict(cfg, ft=dict(ft, resume_from=None)) if resume == "auto" else cfg), found
    if resume == "auto":
        if checkpoint.latest_complete_step(ft["checkpoint_dir"]) is not None:
            return cfg, []  # the same run, continuing (a stop, preemption or requeue)
        log(f"[deadpool] ft.resume_from=auto: {run_dir} holds an earlier attempt's outputs but "
            "no complete checkpoint; they are removed and the run starts afresh")
        return cfg, found
    if resume and _inside(resume, mine):
        return cfg, []  # continues from its own checkpoint
    names = ", ".join(str(p.relative_to(run_dir)) if run_dir in p.parents else str(p)
                      for p in found[:6]) + (" ..." if len(found) > 6 else "")
    raise ValueError(f"run_dir={run_dir} holds another run's outputs ({names}): a second run "
                     "would mix its metrics, validation losses and summary with them. Start "
                     "afresh there with overwrite_run_dir=true (removes them), continue that run "
                     "with ft.resume_from=auto, or choose another run_dir (hydra.run.dir)")


def clear(paths: list[Path]) -> None:
    """Remove what ``check`` named (an earlier run's outputs)."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
