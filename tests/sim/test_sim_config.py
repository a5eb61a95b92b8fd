"""Hydra composition of sim/conf/sim.yaml: every group option composes and builds a scenario."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import sim.config
from sim.layout import Layout

GROUPS = {g: sorted(p.stem for p in (sim.config.SIM_CONF_DIR / g).glob("*.yaml"))
          for g in ("trace", "cluster", "calibration")}
STRATEGY_OPTIONS = sorted(p.stem for p in (sim.config.SIM_CONF_DIR / "strategy").glob("*.yaml"))
SWEEPS = ("sim_scale", "sim_mtbf", "sim_spares")
LAUNCHERS = sorted(p.stem for p in (sim.config.SIM_CONF_DIR / "hydra" / "launcher").glob("*.yaml"))


def compose_sim(overrides=(), hydra_cfg=False):
    with initialize_config_dir(version_base="1.3", config_dir=str(sim.config.CONF_DIR)):
        return compose("sim", overrides=list(overrides), return_hydra_config=hydra_cfg)


def test_defaults_compose_and_build():
    cfg = compose_sim()
    assert list(cfg.strategies) == ["deadpool", "inmem_restart", "checkpoint_restart", "injob_restart", "trainmover", "elastic", "elastic_hsdp", "elastic_spares"]  # the strongest baselines
    assert set(cfg.strategies) <= set(cfg.strategy) and "replication" in cfg.strategy  # runnable, not in the headline
    assert cfg.calibration.name == "gpu_h100"  # GPU projections use a GPU profile
    lay = Layout.from_cfg(OmegaConf.to_container(cfg.cluster))
    assert (lay.num_nodes, lay.dp, lay.nodes_per_group, lay.num_spares) == (2048, 128, 16, 21)
    assert lay.step_time_s == pytest.approx(6.29, abs=0.01)


def test_issue_command_line_overrides():
    cfg = compose_sim(["trace=llama3", "cluster.num_gpus=16384", "duration_days=54", "seeds=20",
                       "strategies=[deadpool,elastic]"])
    assert cfg.seeds == 20 and cfg.duration_days == 54 and list(cfg.strategies) == ["deadpool", "elastic"]


@pytest.mark.parametrize("group, option", [(g, o) for g, opts in GROUPS.items() for o in opts])
def test_every_group_option_composes(group, option):
    overrides = [f"{group}={option}"]
    if group == "trace" and option in ("csv", "addremove"):
        overrides.append("trace.path=/nonexistent.csv")
    cfg = compose_sim(overrides)
    c = OmegaConf.to_container(cfg, resolve=True)
    Layout.from_cfg(c["cluster"])
    if group == "trace" and c["trace"]["source"] == "generate":
        from sim.trace import TraceSpec
        assert TraceSpec.from_cfg(c["trace"]).node_mttf_s > 0


@pytest.mark.parametrize("option", STRATEGY_OPTIONS)
def test_every_strategy_option_composes(option):
    cfg = compose_sim([f"+strategy@strategy.extra={option}", "strategies=[extra]"])
    assert cfg.strategy.extra.kind in ("deadpool", "inmem_restart", "checkpoint_restart", "replication", "elastic",
                                       "injob_restart", "trainmover")


@pytest.mark.parametrize("sweep", SWEEPS)
def test_every_sweep_composes(sweep):
    cfg = compose_sim([f"experiment={sweep}"], hydra_cfg=True)
    assert cfg.hydra.sweeper.params


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_every_launcher_composes(launcher):
    cfg = compose_sim([f"hydra/launcher={launcher}"], hydra_cfg=True)
    assert "_target_" in cfg.hydra.launcher
