"""Simulator benchmark: wall time of the two reference scenarios, against their targets.

    python experiments/bench_sim.py

1. 16,384 GPUs x 54 days x all strategies (5) x 20 seeds (llama3 rates)   target <= 20 s
2. 131,072 GPUs x 180 days, one seed, all strategies (llama3 rates)       target <= 5 s
   (also reported per strategy run)

Also prints event counts: events must scale with failures, not with training steps (the
16k-GPU job takes ~740,000 steps in 54 days; the simulator processes a few thousand events).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import sim.config  # noqa: E402
from sim.simulate import run_scenario  # noqa: E402


def scenario(overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(sim.config.CONF_DIR)):
        return OmegaConf.to_container(compose("sim", overrides=overrides), resolve=True)


def bench(label, overrides, target_s):
    cfg = scenario(overrides)
    t0 = time.perf_counter()
    rows = run_scenario(cfg, progress=False)
    wall = time.perf_counter() - t0
    events = sum(r["events"] for r in rows)
    failures = sum(r["failures"] + r["planned_maintenance"] for r in rows)
    steps = float(cfg["duration_days"]) * 86400 / rows[0]["step_time_s"] * len(rows)
    print(f"{label}\n  wall {wall:6.2f} s   target {target_s:5.1f} s   ratio {wall / target_s:5.2f}   "
          f"({'OK' if wall <= target_s else 'OVER'})")
    print(f"  {len(rows)} runs, {events:,} events, {failures:,} job interruptions, "
          f"{events / max(failures, 1):.1f} events per interruption, {steps:,.0f} training steps simulated")
    for name in cfg["strategies"]:
        rs = [r for r in rows if r["strategy"] == name]
        print(f"    {name:<20} {sum(r['sim_wall_s'] for r in rs) / len(rs):6.3f} s/run  "
              f"{sum(r['events'] for r in rs) / len(rs):9.0f} events/run  goodput {sum(r['goodput'] for r in rs) / len(rs):.4f}")
    return wall


def main() -> None:
    n = len(scenario([])["strategies"])
    a = bench(f"16,384 GPUs x 54 days x {n} strategies x 20 seeds",
              ["trace=llama3", "cluster.num_gpus=16384", "duration_days=54", "seeds=20"], 20.0)
    b = bench(f"131,072 GPUs x 180 days x {n} strategies x 1 seed",
              ["trace=llama3", "cluster.num_gpus=131072", "duration_days=180", "seeds=1"], 5.0)
    print(f"summary: scenario 1 {a:.2f} s (target 20 s), scenario 2 {b:.2f} s (target 5 s)")


if __name__ == "__main__":
    main()
