"""Shared test helpers: compose the training config with Hydra, skip GPU tests without CUDA."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

CONF_DIR = str(Path(__file__).resolve().parents[1] / "conf")


# Jobs the tests compose fork their processes from their node agents (launcher.fork_workers):
# an interpreter start and a torch import saved per process, about half of the suite's CPU time on
# 2 cores. The default (a new interpreter per process) runs in test_agents (which finds processes
# by command line) and wherever a job starts from the command line: test_experiments, test_slurm,
# the verify test in test_hotswap.
FORKED = ["launcher.fork_workers=true"]


def compose_train(overrides: list[str], run_dir: Path) -> dict:
    """The resolved training config as the entry point would build it (run_dir pinned); the
    job's processes forked from their agents unless ``overrides`` say otherwise."""
    from deadpool.train import compose_config

    return compose_config(FORKED + list(overrides), run_dir)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
