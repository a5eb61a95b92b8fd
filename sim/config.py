"""Config plumbing for sim/conf/sim.yaml: where the simulator's configs live, and a resolver.

The simulator's configs are their own Hydra config directory, ``sim/conf/`` (``sim.yaml``, its
groups in ``sim/conf/<group>/``, ``experiment/sim_*.yaml``), apart from the runtime's ``conf/``,
so that ``python -m deadpool.train --help`` and ``python -m sim.run --help`` each list only their
own groups. The ``sim_repo_path`` resolver (a repository path, absolute) is registered on import
for configs that name files in the repository (import this module before composing).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
SIM_CONF_DIR = REPO_ROOT / "sim" / "conf"  # the simulator's config directory (sim.yaml, its groups)
CONF_DIR = SIM_CONF_DIR  # what code composing ``sim`` passes to Hydra (initialize_config_dir)


def repo_path(rel: str) -> str:
    """Absolute path of ``rel`` inside the repository."""
    return str(REPO_ROOT / rel)


if not OmegaConf.has_resolver("sim_repo_path"):
    OmegaConf.register_new_resolver("sim_repo_path", repo_path)
