"""The resolved config of a job, composed as the entry point composes it (``conf/train.yaml``).

``python -m deadpool.train`` builds its config through Hydra's decorator; scripts, tests and the
memory estimator's command line compose the same one here from a list of overrides.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")


def compose_config(overrides: list[str], run_dir: str | Path) -> dict:
    """The resolved config exactly as the entry point builds it, for scripts and tests."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=[*overrides, f"run_dir={run_dir}"])
    return OmegaConf.to_container(cfg, resolve=True)
