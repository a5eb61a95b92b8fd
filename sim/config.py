"""Config plumbing for conf/sim.yaml: the resolver that puts the sim's groups on Hydra's path.

conf/sim.yaml lists ``file://${sim_repo_path:conf/sim}`` (and experiments/sim) in
``hydra.searchpath`` so that its groups can live in conf/sim/<group>/ yet be selected with
short names (``trace=llama3``). The resolver must be registered before Hydra composes the
config: importing this module does it (sim.run, sim.calibrate and the tests import it).
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = REPO_ROOT / "conf"
SIM_CONF_DIR = CONF_DIR / "sim"


def repo_path(rel: str) -> str:
    """Absolute path of ``rel`` inside the repository."""
    return str(REPO_ROOT / rel)


if not OmegaConf.has_resolver("sim_repo_path"):
    OmegaConf.register_new_resolver("sim_repo_path", repo_path)
