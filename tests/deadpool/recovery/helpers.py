"""A coordinator on an in-memory store with a scripted launcher: recovery decisions without
processes."""

from __future__ import annotations

import torch.distributed as dist

from deadpool.control.coordinator import Coordinator
from deadpool.launch.launcher import Launcher
from tests.conftest import compose_train


class FakeLauncher(Launcher):
    """Slots whose process exited (``exited``) or is stopped (``stopped``); records kills."""

    def __init__(self):
        self.exited: dict[int, int] = {}
        self.stopped: set[int] = set()
        self.killed: list[int] = []

    def poll(self, slot: int):
        return self.exited.get(slot)

    def is_stopped(self, slot: int) -> bool:
        return slot in self.stopped

    def kill(self, slot: int) -> None:
        self.killed.append(slot)

    def log_tail(self, slot: int, lines: int = 20) -> str:
        return ""


def coordinator(tmp_path, overrides=(), logs=None, secret: str | None = None,
                store=None) -> Coordinator:
    """``secret``: the coordinator seals and checks every control message (else they pass
    unsealed); ``store``: another store than a fresh in-memory one."""
    cfg = compose_train(["model=tiny", "parallel=dp4", *overrides], tmp_path)
    log = (lambda line: logs.append(line)) if logs is not None else (lambda line: None)
    return Coordinator(cfg, dist.HashStore() if store is None else store, FakeLauncher(), log=log,
                       secret=secret)
