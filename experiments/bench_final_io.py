"""The job's end at dp4, its I/O alone: every rank's full state (``torch.save``, as before issue
37) vs the final checkpoint of unique state, spread (``checkpoint.final``), in one process.

    git worktree add ../before <commit before the change>
    python experiments/bench_final_io.py --before ../before [--params 33039936] [--reps 3]

Four ZeRO-1 fp32 states of a model of ``--params`` parameters (each: the flat parameters, equal
on every rank; a quarter each of master view, exp_avg, exp_avg_sq; the step) are written rank
after rank by the older checkout's ``write_final_state`` and by this one's, interleaved
``--reps`` times, each into a fresh directory (fsync'd files, as both write them). Prints per
run the bytes on disk, the total seconds and the slowest rank's. Expectation: bytes 16/28 =
0.57x (the parameters once instead of 4 times); each rank writes 4 B/param instead of 7.
Without the jobs around it, so start-up and training noise stay out; a loaded machine's disk
still varies run to run (interleaving shows it).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from deadpool.checkpoint import final as after  # noqa: E402
from deadpool.topology import ParallelDims  # noqa: E402

DP = 4


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True, help="a checkout from before the change")
    ap.add_argument("--params", type=int, default=33_039_936)  # model=small d_model=576 8 layers
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location(
        "final_before", Path(args.before) / "deadpool" / "checkpoint" / "final.py")
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    n, shard = args.params, -(-args.params // DP)
    params = torch.randn(n)
    states = {r: {"params": params, "master": params[r * shard:(r + 1) * shard],
                  "exp_avg": torch.randn(shard), "exp_avg_sq": torch.rand(shard),
                  "step": torch.tensor(2.0)} for r in range(DP)}
    layout = ParallelDims(DP).layout
    for _ in range(args.reps):
        for label in ("before", "after"):
            d = Path(tempfile.mkdtemp())
            per = []
            for r in range(DP):
                t = time.perf_counter()
                if label == "before":
                    before.write_final_state(states[r], d / f"rank{r}.pt", lambda: None)
                else:
                    after.write_final_state(d, 2, r, states[r], {"step": 2, "digest": "-"},
                                            shared_names=["params"], layout=layout,
                                            world_size=DP, on_progress=lambda: None)
                per.append(time.perf_counter() - t)
            print(json.dumps({"label": label, "params": n, "bytes": disk_bytes(d),
                              "total_s": round(sum(per), 3), "slowest_rank_s": round(max(per), 3)}),
                  flush=True)
            shutil.rmtree(d)


if __name__ == "__main__":
    main()
