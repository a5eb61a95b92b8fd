"""Entry point: ``python -m deadpool.train [experiment=cpu_hotswap] [overrides...]``.

Builds the config (Hydra, conf/train.yaml), runs the job (coordinator + workers + warm spares),
prints the recovery breakdown, and, with ``verify_against_failure_free=true``, re-runs the same
seed with ``faults=none`` and checks that the final states are bitwise equal.

SIGTERM, SIGUSR1 or SIGINT (Ctrl-C) stop the job: the newest step in memory goes to disk and it
ends saying how to resume (``ft.resume_from=auto``); a second one stops it at once
(``deadpool.launch.stop``). Exit status: 0 completed, 1 failed or not equal, 2 bad config, 128 + the
signal's number when stopped by one.
"""

from __future__ import annotations

import signal
import sys

if __name__ == "__main__":  # until the job is built (imports, config) a signal has nothing to save
    def _before_start(signum, frame):
        sys.stderr.write(f"[deadpool] {signal.Signals(signum).name} before the job started\n")
        raise SystemExit(128 + signum)

    for _sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(_sig, _before_start)

import copy  # (after the handlers: importing torch takes seconds)
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from deadpool.launch.job import run_job
from deadpool.launch.report import compare_final_states, print_report
from deadpool.launch.stop import Stopper


def to_plain(cfg: DictConfig) -> dict:
    d = OmegaConf.to_container(cfg, resolve=True)
    d.pop("hydra", None)
    return d


def run(cfg: dict) -> int:
    stop = Stopper().install()
    try:
        return _run(cfg, stop)
    finally:
        stop.restore()


def _run(cfg: dict, stop: Stopper) -> int:
    try:
        summary = run_job(cfg, stop=stop)
    except ValueError as e:  # bad config: say which field, start nothing
        print(f"[deadpool] config error: {e}", file=sys.stderr)
        return 2
    print_report(summary)
    if summary["outcome"] == "preempted":
        return 128 + (stop.signum or 15)  # (an agent's request without a number: SIGTERM's)
    ok = summary["outcome"] == "completed"
    if cfg.get("verify_against_failure_free") and ok:
        ref = copy.deepcopy(cfg)
        ref["faults"] = {"events": []}
        ref["run_dir"] = str(Path(cfg["run_dir"]) / "reference_failure_free")
        ref["ft"]["checkpoint_dir"] = str(Path(ref["run_dir"]) / "checkpoints")
        print("[deadpool] re-running the same seed without faults for comparison ...", flush=True)
        ref_summary = run_job(ref, log=lambda *a, **k: None, stop=stop)
        equal, why = compare_final_states(cfg["run_dir"], ref["run_dir"])
        same_digest = ref_summary["final_digest"] == summary["final_digest"]
        verdict = "EQUAL" if equal and same_digest else "DIFFERENT"
        print(f"[deadpool] final state vs failure-free run of the same seed: {verdict} ({why})")
        ok = ok and equal and same_digest
    return 0 if ok else 1


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> None:
    code = run(to_plain(cfg))
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
