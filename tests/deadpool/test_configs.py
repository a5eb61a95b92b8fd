"""Every runtime config group option composes, resolves and passes validation."""

import os
from pathlib import Path

import pytest

from deadpool.launch.config import CONF_DIR
from deadpool.launch.job import validate
from deadpool.launch.memory_tables import MODELS
from tests.conftest import compose_train

GROUPS = ["model", "parallel", "ft", "faults", "launcher", "data", "experiment"]


def options(group):
    return sorted(p.stem for p in (Path(CONF_DIR) / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in options(g)])
def test_every_option_composes(group, option, tmp_path, monkeypatch):
    monkeypatch.setenv("DEADPOOL_STORE_HOST", "127.0.0.1")
    extra = []
    if option.startswith("llama"):  # LLaMA models with their A100 layouts (memory of the GPU)
        model, layout = ((option, f"{MODELS[option]}_a100_80g") if group == "model"
                         else (f"llama_{option.split('_')[0][5:]}", option))
        extra = [f"model={model}", f"parallel={layout}", "memory.gpu_gb=80",
                 "memory.host_gb_per_node=4096", "seq_len=1024", "batch_size=4"]
    elif option == "kill_3d_two_ranks_swapped":
        extra = ["parallel=dp2_tp2_pp2"]
    cfg = compose_train([f"{group}={option}"] + extra, tmp_path)
    if (group, option) in (("data", "tokens"), ("data", "megatron")):  # data.path is required
        with pytest.raises(ValueError, match="needs data.path"):
            validate(cfg)
        return
    assert cfg["run_dir"] == str(tmp_path)
    assert cfg["ft"]["checkpoint_dir"] == f"{tmp_path}/checkpoints"
    if (group, option) == ("model", "gpt_1b"):
        # 1.4 B parameters in fp32 at dp4 need ~225 GB of host RAM as CPU processes: refused
        # here, naming why; it is meant for GPUs, where it fits an 80 GB card
        if os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") < 200e9:
            with pytest.raises(ValueError, match="does not fit: .* of RAM"):
                validate(cfg)
        cfg = compose_train([f"{group}={option}", "memory.gpu_gb=80",
                             "memory.host_gb_per_node=4096"], tmp_path)
    validate(cfg)


def test_demo_experiment_is_what_the_readme_says(tmp_path):
    cfg = compose_train(["experiment=cpu_hotswap"], tmp_path)
    assert cfg["parallel"]["dp"] == 4 and cfg["ft"]["num_spares"] == 1
    assert cfg["faults"]["events"] == [{"rank": 1, "step": 12, "phase": "mid_step", "kind": "kill"}]
    assert cfg["verify_against_failure_free"] is True


@pytest.mark.parametrize("override,msg", [
    ("parallel.tp=3", "not a multiple of ranks_per_node=4"),
    ("model.n_heads=1", "n_heads=1 is not divisible by parallel.tp=2"),
    ("model.n_heads=3", "d_model=128 must be n_heads=3 heads of an even size"),
    ("model.n_kv_heads=3", "n_kv_heads=3 must divide model.n_heads=4"),
    ("model.n_kv_heads=1", "n_kv_heads=1 is not divisible by parallel.tp=2"),
    ("model.rope_theta=abc", "model.rope_theta must be a number"),
    ("activation_checkpointing=most", "activation_checkpointing must be one of"),
    ("parallel.pp=4", "fewer than parallel.pp=4"),
    ("ft.replicate=half", "ft.replicate"),
    ("ft.num_spares=-1", "num_spares"),
    ("ft.heartbeat_timeout_s=0.05", "heartbeat_timeout_s"),
    ("backend=nccl", "backend=nccl needs device=cuda"),
    ("faults=kill_last", None),
    ("precision=fp16", r"precision must be one of \['fp32', 'bf16'\], got 'fp16'"),
    ("grad_reduce_dtype=fp16", "grad_reduce_dtype must be one of"),
    ("lr_schedule=linear", r"lr_schedule must be one of \['constant', 'cosine', 'wsd'\]"),
    ("warmup_steps=-1", "warmup_steps"),
    ("min_lr_ratio=1.5", "min_lr_ratio"),
    ("wsd_decay_ratio=0", "wsd_decay_ratio"),
    ("grad_clip=0", "grad_clip must be > 0 or null"),
])
def test_validation_names_the_bad_field(override, msg, tmp_path):
    cfg = compose_train([override, "parallel=dp2"] + (
        ["parallel.tp=2"] if override.startswith(("model.n_heads", "model.n_kv")) else []),
        tmp_path)
    if msg is None:  # kill_last targets rank 3, which dp2 does not have
        with pytest.raises(ValueError, match="ranks are 0..1"):
            validate(cfg)
    else:
        with pytest.raises(ValueError, match=msg):
            validate(cfg)


def test_each_entry_point_lists_only_its_own_config_groups():
    """``train --help`` must not offer the simulator's groups or sim_* experiments (they fail under
    train), nor ``sim.run --help`` the runtime's."""
    import subprocess
    import sys
    root = Path(CONF_DIR).parent

    def groups(module):
        out = subprocess.run([sys.executable, "-m", module, "--help"], cwd=root, capture_output=True,
                             text=True, timeout=120, check=True).stdout
        body = out.split("== Configuration groups ==", 1)[1].split("== Config ==", 1)[0]
        return dict(ln.split(": ", 1) for ln in body.splitlines() if ": " in ln)
    train, simulator = groups("deadpool.train"), groups("sim.run")
    assert {"model", "parallel", "ft", "faults", "data", "experiment"} <= set(train)
    assert not [g for g in train if g.startswith(("sim", "trace", "cluster", "calibration"))], train
    assert "sim_" not in train["experiment"] and "cpu_hotswap" in train["experiment"]
    assert {"trace", "cluster", "calibration", "experiment"} <= set(simulator)
    assert not {"model", "parallel", "ft", "faults"} & set(simulator), simulator
    assert simulator["experiment"].split(", ") == sorted(
        p.stem for p in (root / "sim" / "conf" / "experiment").glob("*.yaml"))


def test_the_readmes_3d_example_has_no_placement_warning(tmp_path):
    """The 3D command in docs/runtime.md must compose to a sound layout (``check_placement``)."""
    import shlex

    from deadpool.policies import check_placement
    from deadpool.topology import ParallelDims
    readme = (Path(CONF_DIR).parent / "docs" / "runtime.md").read_text()
    lines = readme.split("    # 3D: 8 ranks", 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if "python -m deadpool.train" in ln)
    cmd = []
    for ln in lines[start:]:  # the command and its continuation lines
        cmd.append(ln.rstrip("\\ "))
        if not ln.rstrip().endswith("\\"):
            break
    overrides = [a for a in shlex.split(" ".join(cmd)) if "=" in a]
    assert any(a.startswith("parallel") for a in overrides), overrides
    cfg = compose_train(overrides, tmp_path)
    dims = ParallelDims.from_config(cfg["parallel"])
    assert (dims.dp, dims.tp, dims.pp) == (2, 2, 2)
    assert check_placement(dims, cfg["ft"]["buddy_policy"], cfg["ft"].get("replicate", "unique"),
                           int(cfg["ft"].get("replicas", 1))) == []
