"""Entry point: ``python -m sim.run [Hydra overrides]`` (config: sim/conf/sim.yaml).

Runs every strategy in ``strategies`` on the same trace for each of ``seeds`` seeds and
writes ``summary.csv`` (one row per strategy and seed) and ``aggregate.csv`` (mean and 95%
CI per strategy) at the top of the Hydra run directory, then prints the ETTR table.

    python -m sim.run trace=llama3 cluster.num_gpus=16384 duration_days=54 seeds=20
    python -m sim.run -m experiment=sim_scale hydra/launcher=sim_joblib
"""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

import sim.config  # noqa: F401  (registers the searchpath resolver before composition)
from sim import report
from sim.simulate import run_scenario


@hydra.main(version_base="1.3", config_path="conf", config_name="sim")
def main(cfg: DictConfig) -> float:
    out_dir = HydraConfig.get().runtime.output_dir
    c = OmegaConf.to_container(cfg, resolve=True)
    try:
        rows = run_scenario(c, progress=bool(c.get("progress", True)),
                            trace_dir=out_dir if c.get("save_traces") else None)
    except ValueError as e:  # bad config: say which field, no traceback
        print(f"[sim] config error: {e}", file=sys.stderr)
        sys.exit(2)
    _, agg = report.write(rows, out_dir)
    print(f"[sim] {c['trace'].get('name')} x {c['cluster']['num_gpus']} GPUs x "
          f"{c['duration_days']} days x {c['seeds']} seeds -> {out_dir}/summary.csv")
    print(report.table(agg))
    return float(agg["goodput_mean"].max())


if __name__ == "__main__":
    main()
