"""Shared test helpers: compose the training config with Hydra, skip GPU tests without CUDA."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


# Jobs the tests compose fork their processes from their node agents (launcher.fork_workers):
# an interpreter start and a torch import saved per process, about half of the suite's CPU time on
# 2 cores. The default (a new interpreter per process) runs in test_agents (which finds processes
# by command line) and wherever a job starts from the command line: test_experiments, test_slurm,
# the verify test in test_hotswap. Their node agents are forks of one zygote (launcher.fork_agents:
# one more interpreter start and torch import saved per node; a tiny dp2 x tp2 x pp2 job with 5
# agents: ~21 -> ~9 s of CPU, docs/runtime.md), except where a job starts from the command line
# without FORKED.
FORKED = ["launcher.fork_workers=true", "launcher.fork_agents=true"]

# A tiny pipelined job's micro-batches in tests: parallel.microbatches=auto picks >= 9 (pp - 1)
# (8 at pp=2, batch 8); 4 still runs 1F1B's warm-up, steady and cool-down phases on every stage,
# at less CPU per step (a 10-step dp2 x tp2 x pp2 job measured 25.2 s of CPU against 25.8 s under
# auto, loaded 2-core machine: start-up dominates a tiny job; it counts in the longer ones). The auto rule itself is tested on its own
# (tests/deadpool/parallel/test_pipeline.py) and in the jobs started from the command line; a
# test that means auto says so in its overrides; real models' layouts (memory fits) keep auto.
TEST_MICROBATCHES = 4


_SERVER: list = []  # [socket path or None, its Popen]: started at the first job composed


def zygote_server() -> str | None:
    """The session's zygote server (deadpool/launch/zygote_server.py): the jobs composed here fork
    their zygotes from it, not from a new interpreter each (~3.5 s of CPU and of start-up per
    job; a job started from the command line keeps its own zygote). None where it cannot start
    (the jobs then start their own), or with DEADPOOL_TEST_ZYGOTE_SERVER=0 in the environment
    (to time the suite without it)."""
    if not _SERVER and os.environ.get("DEADPOOL_TEST_ZYGOTE_SERVER") == "0":
        _SERVER.extend([None, None])
    if not _SERVER:
        import atexit
        import shutil
        import tempfile

        from deadpool.launch import zygote_server as zs
        sock = Path(tempfile.mkdtemp(prefix="deadpool-zs-")) / "sock"  # (mkdtemp: mode 0700)
        try:
            proc = zs.start(sock)
        except (OSError, RuntimeError) as e:
            print(f"tests: no zygote server ({e}); every job starts its own zygote")
            _SERVER.extend([None, None])
            return None
        _SERVER.extend([str(sock), proc])

        def stop():  # (the server removes its socket; its directory is the session's)
            proc.stdin.close()
            proc.wait(30)
            shutil.rmtree(sock.parent, ignore_errors=True)
        atexit.register(stop)
    return _SERVER[0]


def compose_train(overrides: list[str], run_dir: Path) -> dict:
    """The resolved training config as the entry point would build it (run_dir pinned); the
    job's processes forked from their agents unless ``overrides`` say otherwise (their zygote
    forked from the session's ``zygote_server``); a tiny pipelined job's micro-batches
    ``TEST_MICROBATCHES`` unless ``overrides`` name ``parallel.microbatches``."""
    from deadpool.launch.config import compose_config

    cfg = compose_config(FORKED + list(overrides), run_dir)
    if cfg["launcher"].get("fork_agents") and "zygote_server" in cfg["launcher"]:
        cfg["launcher"]["zygote_server"] = zygote_server()
    par = cfg["parallel"]
    if ("model=tiny" in overrides and int(par["pp"]) > 1
            and not any(o.startswith("parallel.microbatches=") for o in overrides)
            and int(cfg["batch_size"]) % TEST_MICROBATCHES == 0):
        par["microbatches"] = TEST_MICROBATCHES
    return cfg


_FAILURE_FREE: dict[str, tuple[Path, dict]] = {}


@pytest.fixture(scope="session")
def failure_free(tmp_path_factory):
    """``failure_free(overrides)``: the run directory and summary of the failure-free job of
    ``overrides`` (``faults=none`` added), run once per session. The key is the whole resolved
    config but its run directory, so modules whose references resolve alike share one run and
    any difference (a step count, a spare, a chunk size) gets its own."""

    def get(overrides: list[str]) -> tuple[Path, dict]:
        from deadpool.launch.job import run_job

        overrides = list(overrides) + ["faults=none"]
        key = json.dumps(compose_train(overrides, "RUN_DIR"), sort_keys=True, default=str)
        if key not in _FAILURE_FREE:
            run_dir = tmp_path_factory.mktemp("failure_free")
            summary = run_job(compose_train(overrides, run_dir), log=lambda *a, **k: None)
            assert summary["outcome"] == "completed" and not summary["recoveries"], \
                summary.get("message")
            _FAILURE_FREE[key] = (run_dir, summary)
        return _FAILURE_FREE[key]

    return get


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
