"""Drain a node: move its ranks to warm spares while the job trains on, then release it.

    python -m deadpool.drain RUN_DIR --node N [--timeout-s 60]

For maintenance (a firmware update, a node an operator distrusts): the node's ranks are migrated
at a step boundary (``recovery.migrate``: every rank holds at one step, the node's ranks' state
goes to spares through that step's replicas, nothing is rolled back or recomputed) and the node's
processes exit; its warm spares leave the pool. The request is refused, with the reason, when
fewer spares are free off the node than it holds ranks, or when the job runs without node
agents (``launcher.agents=false``: the pause cannot be pushed).

Like every control message the request is sealed with the job's secret (``deadpool/store/auth.py``:
``DEADPOOL_JOB_SECRET`` or ``DEADPOOL_JOB_SECRET_FILE``), as a node agent's stop request is
(``deadpool.launch.stop``): ``job/drain/<id>`` ({"node"}), a wake-up hint ``job/num_drains`` the
coordinator reads with its loop's counters, and its sealed answer ``job/drain/<id>/reply``
({"ok", "message"}), written once the migration's plan is out or the request is refused. The
store's address is the run directory's ``job.json`` (``_store``). Exit status: 0 drained, 1
refused, 2 no answer within the timeout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from deadpool.recovery.detect import forged
from deadpool.store import auth
from deadpool.store.protocol import Seal, wake_coordinator

HINT = "job/num_drains"  # a wake-up hint (unsealed): requests 1..n may exist


def request_key(i: int) -> str:
    return f"job/drain/{i}"


def reply_key(i: int) -> str:
    return f"job/drain/{i}/reply"


def request(store, seal: Seal, node: int) -> int:
    """Ask the coordinator to drain ``node``; returns the request's id."""
    i = int(store.add(HINT, 1))
    store.set(request_key(i), seal.wrap(request_key(i), json.dumps({"node": int(node)})))
    wake_coordinator(store)
    return i


def answer(store, seal: Seal, i: int, timeout_s: float) -> dict | None:
    """The coordinator's sealed answer to request ``i`` (None: none within ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check([reply_key(i)]):
            text = seal.open(reply_key(i), store.get(reply_key(i)))
            if text is not None:
                return json.loads(text)
        time.sleep(0.05)
    return None


class Requests:
    """Coordinator side: the drain requests not yet answered, read when the hint moves."""

    def __init__(self):
        self.seen = 0  # requests 1..seen were read

    def poll(self, coord) -> list[tuple[int, int]]:
        """New sealed requests as ``(id, node)``; forged ones are logged once and dropped."""
        n = coord.counter(HINT)
        out = []
        while self.seen < n:
            key = request_key(self.seen + 1)
            if not coord.store.check([key]):
                break  # bumped, not written yet: read at the next turn
            self.seen += 1
            text = coord.seal.open(key, coord.store.get(key))
            if text is None:
                forged(coord, "drain request")
                continue
            out.append((self.seen, int(json.loads(text)["node"])))
        return out

    @staticmethod
    def reply(coord, i: int, ok: bool, message: str) -> None:
        coord.log(f"[coordinator] drain request {i}: {message}")
        coord.store.set(reply_key(i), coord.seal.wrap(reply_key(i), json.dumps(
            {"ok": ok, "message": message})))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", type=Path, help="the running job's run directory (job.json)")
    ap.add_argument("--node", type=int, required=True, help="the node to drain")
    ap.add_argument("--timeout-s", type=float, default=60.0, help="wait this long for the answer")
    args = ap.parse_args(argv)
    cfg = json.loads((args.run_dir / "job.json").read_text())
    secret = auth.load_secret()
    store = auth.open_store(cfg["_store"]["host"], int(cfg["_store"]["port"]), secret, 10.0)
    seal = Seal(secret)
    i = request(store, seal, args.node)
    got = answer(store, seal, i, args.timeout_s)
    if got is None:
        print(f"[drain] node {args.node}: no answer from the coordinator within "
              f"{args.timeout_s:.0f} s", file=sys.stderr)
        return 2
    print(f"[drain] node {args.node}: {got['message']}", file=sys.stdout if got["ok"] else sys.stderr)
    return 0 if got["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
