"""Run one DeadPool job end to end on this machine: store, coordinator, processes, outputs.

``run_job(cfg)`` is what ``deadpool.train``, the tests and the benchmarks call. ``cfg`` is the
resolved Hydra config as a plain dict. The run directory receives::

    job.json        the resolved config the processes read
    logs/slot*.log  each process's output
    metrics.jsonl   per-step, per-rank metrics (merged from metrics/slot*.jsonl)
    final/          the final state: a checkpoint of unique state (checkpoint.final)
    summary.json    recoveries with their timing breakdown, final digest, outcome
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from deadpool import checkpoint
from deadpool.agent.events import EventLog, WakeListener
from deadpool.agent.presence import PresenceServer
from deadpool.control.coordinator import Coordinator
from deadpool.data import check_data, start_verify
from deadpool.errors import JobFailed
from deadpool.export.hf_import import check_config as check_init_from
from deadpool.launch import run_dir as run_dirs
from deadpool.launch.launcher import (AgentLauncher, ExternalAgentLauncher, ExternalLauncher, LocalLauncher,
                               job_processes)
from deadpool.control.liveness import NodeLiveness
from deadpool.launch.memory import check_fits
from deadpool.launch.report import write_outputs
from deadpool.launch.stop import HardStop, Stopper
from deadpool.model import check_activation_checkpointing, model_config
from deadpool.policies import buddies_table, check_placement, max_replicas
from deadpool.rank import lr_schedule, netif, precision
from deadpool.rank.comm import resolve_backend
from deadpool.rank.faults import FaultEvent
from deadpool.rank.strategies import strategy_of
from deadpool.rank.tensorboard_log import check as check_tensorboard, write_recoveries
from deadpool.recovery import disk, preempt
from deadpool.recovery.plan import SOURCE_KINDS
from deadpool.settings import microbatch_note, num_microbatches  # noqa: F401 (re-exported)
from deadpool.snapshot import SnapshotSchedule
from deadpool.store import auth
from deadpool.store.protocol import Seal
from deadpool.topology import ParallelDims


def validate(cfg: dict) -> None:
    """Reject bad configs before any process starts, with a message naming the field."""
    p, ft = cfg["parallel"], cfg["ft"]
    validate_numbers(cfg)
    validate_layout(cfg)
    if int(cfg["num_steps"]) < 1:
        raise ValueError("num_steps must be >= 1")
    precision.check(cfg)
    lr_schedule.check(cfg)
    clip = cfg.get("grad_clip")
    if clip is not None and not float(clip) > 0:
        raise ValueError(f"grad_clip must be > 0 or null, got {clip!r}")
    strategy_of(ft)  # raises on an unknown strategy or a contradicting knob
    SnapshotSchedule(int(ft["snapshot_interval_steps"]), int(ft["max_snapshot_lag_steps"]),
                     every=int(ft["snapshot_adapt_every_steps"]),
                     adaptive=bool(ft["snapshot_adaptive"]),
                     overhead_target=ft["snapshot_overhead_target"],
                     probe_every=int(ft["snapshot_probe_every_steps"]))  # raises on bad values
    if int(ft["num_spares"]) < 0:
        raise ValueError("ft.num_spares must be >= 0")
    if ft["heartbeat_timeout_s"] <= 2 * ft["heartbeat_interval_s"]:
        raise ValueError("ft.heartbeat_timeout_s must exceed 2 x ft.heartbeat_interval_s")
    if ft["heartbeat_hard_timeout_s"] < ft["heartbeat_timeout_s"]:
        raise ValueError("ft.heartbeat_hard_timeout_s must be >= ft.heartbeat_timeout_s")
    if remote_agents(cfg) and ft["coordinator_timeout_s"] <= ft["node_timeout_s"]:
        raise ValueError("ft.coordinator_timeout_s must exceed ft.node_timeout_s: a node cut off "
                         "from the coordinator fences itself at the node timeout, before its "
                         "ranks would take the coordinator for dead and write what they hold")
    if ft["on_no_spare"] not in ("elastic", "checkpoint_restart", "checkpoint_and_stop"):
        raise ValueError("ft.on_no_spare must be elastic, checkpoint_restart or checkpoint_and_stop, "
                         f"got {ft['on_no_spare']!r}")
    if ft["on_no_spare"] != "checkpoint_and_stop" and not ft["snapshot"] and ft["num_spares"]:
        raise ValueError(f"ft.on_no_spare={ft['on_no_spare']} writes the state from memory: it needs "
                         "ft.snapshot=true")
    gdp = p.get("global_dp")
    if gdp is not None and int(gdp) < int(p["dp"]):
        raise ValueError(f"parallel.global_dp={gdp} must be >= parallel.dp={p['dp']}")
    if ft.get("elastic_mode", "in_place") not in ("in_place", "relaunch"):
        raise ValueError(f"ft.elastic_mode must be 'in_place' or 'relaunch', got {ft['elastic_mode']!r}")
    if ft.get("elastic_regrow_after_s") is not None and float(ft["elastic_regrow_after_s"]) < 0:
        raise ValueError("ft.elastic_regrow_after_s must be >= 0 or null")
    agents = uses_agents(cfg)
    if agents and not 0 < float(ft["agent_interval_s"]) <= float(ft["node_timeout_s"]) / 4:
        raise ValueError("ft.agent_interval_s must be > 0 and <= ft.node_timeout_s / 4 (a node is "
                         "lost after missing several records, not one)")
    if not agents and any(str(ev.get("kind")) in ("kill_node", "stop_agent")
                          for ev in cfg["faults"]["events"]):
        raise ValueError("kill_node and stop_agent faults need node agents (launcher.agents=true)")
    if ft["progress_timeout_s"] <= ft["heartbeat_timeout_s"]:
        raise ValueError("ft.progress_timeout_s must exceed ft.heartbeat_timeout_s")
    if not float(ft["stop_timeout_s"]) > float(ft["status_timeout_s"]):
        raise ValueError("ft.stop_timeout_s must exceed ft.status_timeout_s (a stop collects the "
                         "ranks' statuses before it writes)")
    if ft["coordinator_timeout_s"] <= 2 * ft["heartbeat_interval_s"]:
        raise ValueError("ft.coordinator_timeout_s must exceed 2 x ft.heartbeat_interval_s")
    if ft.get("replicate", "unique") not in ("unique", "full"):
        raise ValueError(f"ft.replicate must be 'unique' or 'full', got {ft['replicate']!r}")
    replicas = ft.get("replicas", 1)
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        raise ValueError(f"ft.replicas must be an integer >= 1, got {replicas!r}")
    buddies_table(ParallelDims.from_config(p), ft["buddy_policy"], replicas)  # k other nodes exist
    if ft.get("rebuild", "affected") not in ("affected", "all"):
        raise ValueError(f"ft.rebuild must be 'affected' or 'all', got {ft['rebuild']!r}")
    bad = [k for k in ft["state_sources"] if k not in SOURCE_KINDS]
    if bad or not ft["state_sources"]:
        raise ValueError(f"ft.state_sources must list some of {list(SOURCE_KINDS)}, got {ft['state_sources']}")
    world = ParallelDims.from_config(p).world_size
    slots = world + int(ft["num_spares"])
    for ev in cfg["faults"]["events"]:
        FaultEvent.from_cfg(ev)  # phase, kind, rank-or-slot
        if ev.get("rank") is not None and not 0 <= int(ev["rank"]) < world:
            raise ValueError(f"fault {ev} names rank {ev['rank']}, but ranks are 0..{world - 1}")
        if ev.get("slot") is not None and not 0 <= int(ev["slot"]) < slots:
            raise ValueError(f"fault {ev} names slot {ev['slot']}, but slots are 0..{slots - 1}")
        if not 0 <= int(ev["step"]) < int(cfg["num_steps"]):
            raise ValueError(f"fault {ev} is at step {ev['step']}, outside 0..{cfg['num_steps'] - 1}")
    backend = cfg.get("backend", "auto")
    resolve_backend(cfg["device"], backend)
    if cfg["device"].startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            raise ValueError("device=cuda but no CUDA device is visible")
        n_gpu = torch.cuda.device_count()
        if (backend != "gloo" and cfg["launcher"]["name"] == "local" and slots > n_gpu
                and not cfg["launcher"].get("share_gpu")):
            raise ValueError(f"NCCL needs one GPU per process: {slots} processes (ranks + spares) "
                             f"on {n_gpu} visible GPU(s); use backend=gloo to share GPUs, or "
                             "launcher.share_gpu=true (a test mode: NCCL over loopback sockets)")
    if ft.get("resume_from"):
        if not Path(ft["resume_from"]).is_dir():
            raise ValueError(f"ft.resume_from={ft['resume_from']}: no such directory")
        try:
            checkpoint.latest_step_dir(ft["resume_from"])
        except FileNotFoundError as e:
            raise ValueError(f"ft.resume_from={ft['resume_from']}: {e}") from None
    check_data(cfg)  # data=tokens|megatron: manifest/index, sizes, vocabulary (no shard read)
    check_init_from(cfg)  # model.init_from: config.json fields and every tensor's shape
    check_tensorboard(cfg)
    check_fits(cfg)


# fields that must be numbers (Hydra passes `lr=abc` through as a string)
NUMBERS = {"seed": int, "num_steps": int, "batch_size": int, "seq_len": int, "lr": float,
           "weight_decay": float, "log_every_steps": int, "eval_every_steps": int,
           "eval_batches": int}


def _number(name: str, v, kind) -> None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    if not ok or (kind is int and isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {v!r}")


def validate_numbers(cfg: dict) -> None:
    """Numeric fields hold numbers: top-level training fields and every model field."""
    for key, kind in NUMBERS.items():
        if key in cfg:
            _number(key, cfg[key], kind)
    for key, v in cfg["model"].items():
        if v is not None and key != "init_from":  # null: the field's default (e.g. n_kv_heads)
            _number(f"model.{key}", v, float)
    if int(cfg["seq_len"]) > int(cfg["model"]["max_seq_len"]):
        raise ValueError(f"seq_len={cfg['seq_len']} exceeds model.max_seq_len={cfg['model']['max_seq_len']}")
    if int(cfg.get("eval_every_steps") or 0) < 0 or int(cfg.get("eval_batches", 1)) < 1:
        raise ValueError("eval_every_steps must be >= 0 and eval_batches >= 1")


def validate_layout(cfg: dict) -> None:
    """The model must hold together (``model.model_config``: heads, KV heads, rotary base) and
    split evenly over the layout (query and KV heads, vocabulary and FFN over tp; layers over pp;
    the batch into micro-batches); ``activation_checkpointing`` must name a mode."""
    p, m = cfg["parallel"], model_config(cfg["model"])
    check_activation_checkpointing(cfg.get("activation_checkpointing", "none"))
    ParallelDims.from_config(p)  # degrees and node shape
    tp, pp = int(p["tp"]), int(p["pp"])
    for what, n in (("model.n_heads", m.n_heads), ("model.vocab_size", m.vocab_size),
                    ("model.n_kv_heads", m.n_kv_heads),  # a rank holds whole KV heads
                    ("the SwiGLU width (model.ffn_mult, ffn_multiple_of)", m.ffn_hidden)):
        if n % tp:
            raise ValueError(f"{what}={n} is not divisible by parallel.tp={tp}")
    if m.n_layers < pp:
        raise ValueError(f"model.n_layers={m.n_layers} is fewer than parallel.pp={pp} stages")
    mb = num_microbatches(cfg)
    if mb < 1 or int(cfg["batch_size"]) % mb:
        raise ValueError(f"parallel.microbatches={mb} must divide batch_size={cfg['batch_size']}")


def run_job(cfg: dict, log=print, stop: Stopper | None = None) -> dict:
    """``stop``: a ``stop.Stopper`` whose signals stop the job (``train.run`` installs one); an
    agent's stop request (``deadpool.launch.stop``) is honoured without one too. A run directory
    holding another run's outputs is refused, started afresh or continued (``run_dir.check``)."""
    cfg, earlier = run_dirs.check(cfg, log)
    cfg = resolve_resume(cfg, log)
    validate(cfg)
    run_dirs.clear(earlier)  # (only once the config is known to be good)
    p = cfg["parallel"]
    dims = ParallelDims.from_config(p)
    for warning in check_placement(dims, cfg["ft"]["buddy_policy"], cfg["ft"].get("replicate", "unique"),
                                   int(cfg["ft"].get("replicas", 1))):
        log(f"[deadpool] placement warning: {warning}")
    if microbatch_note(cfg):  # parallel.microbatches=auto under pipelining: what it chose
        log(microbatch_note(cfg))
    run_dir = Path(cfg["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    netif.check_store_host(cfg)  # a multi-node job served from loopback: refused, with why
    master = auth.serve_store(cfg["launcher"]["host"], int(cfg["launcher"]["port"]))
    t0 = time.time()
    history: list[dict] = []  # recoveries of earlier launches (ft=checkpoint_restart)
    restart = None
    stop = stop or Stopper()
    # the shards' checksums while the job runs: a bad one stops it as a signal would
    verifying = start_verify(cfg, lambda why: stop.request(why, None), log)
    for attempt in range(int(cfg["ft"].get("max_restarts", 0)) + 1):
        coord, store = _launch(cfg, master, run_dir, log, restart, stop)
        history.extend(coord.recoveries)
        if coord.outcome not in ("restart", "shrink", "grow") or stop.why is not None:
            break
        restart = history.pop()  # completed by the relaunch's coordinator
        if cfg["launcher"]["name"] != "local":  # srun / torchrun relaunch (e.g. a Slurm requeue)
            coord.outcome = "unrecoverable"
            coord.message += (f"; relaunch the job with ft.resume_from={cfg['ft']['checkpoint_dir']}"
                              " (processes are started by the launcher, not by this coordinator)")
            history.append(restart)
            break
        restart.t_relaunch = time.time()
        restart.teardown_s = restart.t_relaunch - restart.t_detect
        cfg = _relaunch_cfg(cfg, store, coord.gen + 1, restart, log)
        _clear(store)  # the relaunch gets a fresh namespace: nothing reads this one any more
        log(f"[deadpool] relaunch {attempt + 1}: every process restarts from "
            f"{cfg['ft']['resume_from'] or 'step 0'} at dp={cfg['parallel']['dp']}")
    else:
        coord.outcome = "failed"
        coord.message = f"{cfg['ft']['max_restarts']} relaunches used up (ft.max_restarts)"
        history.append(restart)
    coord.recoveries = history
    if verifying is not None:
        verifying.finish()
        if verifying.error is not None:
            coord.outcome, coord.message = "failed", verifying.error
    summary = write_outputs(cfg, coord, run_dir, wall_s=time.time() - t0)
    write_recoveries(cfg, summary)  # logging.tensorboard: each recovery as TensorBoard entries
    return summary


def uses_agents(cfg: dict) -> bool:
    """The job runs node agents (``launcher.agents``: local and Slurm; torchrun has none)."""
    return cfg["launcher"]["name"] in ("local", "slurm") and bool(cfg["launcher"].get("agents"))


def remote_agents(cfg: dict) -> bool:
    """Node agents on other hosts (srun starts them): each holds a presence connection and a
    cut-off one fences itself (``agent.presence``)."""
    return uses_agents(cfg) and cfg["launcher"]["name"] != "local"


def resolve_resume(cfg: dict, log) -> dict:
    """``ft.resume_from=auto``: the newest complete checkpoint under ``ft.checkpoint_dir`` (a
    job stopped, preempted or requeued in the same run directory), else a fresh start."""
    ft = cfg["ft"]
    if ft.get("resume_from") != "auto":
        return cfg
    found = checkpoint.resolve_resume("auto", ft["checkpoint_dir"])
    if found is None:
        log(f"[deadpool] ft.resume_from=auto: no complete checkpoint under {ft['checkpoint_dir']}"
            "; starting from step 0")
    else:
        log(f"[deadpool] ft.resume_from=auto: resuming from the checkpoint of step "
            f"{checkpoint.latest_complete_step(found)} in {found}")
    return dict(cfg, ft=dict(ft, resume_from=found))


def _launch(cfg: dict, master, run_dir: Path, log, restart: dict | None, stop: Stopper):
    """Start every process of the job and coordinate it until it ends; returns the coordinator
    and the launch's store namespace."""
    # the secret goes to the processes through their environment (local) or a 0600 file (SLURM),
    # never into job.json or a log; the coordinator only sees the job's namespace (deadpool/store/auth.py).
    # A relaunch gets a fresh secret, hence a fresh namespace: nothing of the last launch is seen.
    secret = auth.new_secret() if cfg["launcher"]["name"] == "local" else auth.load_secret()
    store = auth.namespaced(master, secret)
    cfg = dict(cfg, _store={"host": cfg["launcher"]["host"], "port": master.port})
    presence = None
    if remote_agents(cfg):
        presence = PresenceServer(cfg["launcher"]["host"], secret, lambda node: on_gone(node),
                                  on_forged=lambda: log("[coordinator] a presence hello without "
                                                        "the job's secret: ignored"))
        cfg["_store"]["presence"] = presence.port
    job_json = run_dir / "job.json"
    job_json.write_text(json.dumps(cfg, indent=1))
    n_workers = ParallelDims.from_config(cfg["parallel"]).world_size
    slots = list(range(n_workers + int(cfg["ft"]["num_spares"])))
    live = events = waker = None
    if uses_agents(cfg):
        ft = cfg["ft"]
        events = EventLog(store, Seal(secret))
        waker = WakeListener(lambda: auth.open_store(cfg["launcher"]["host"], master.port, secret))
        local = cfg["launcher"]["name"] == "local"
        launcher = (AgentLauncher if local else ExternalAgentLauncher)(
            run_dir, job_json, secret, cfg, None, events)
        live = launcher.live = NodeLiveness(
            float(ft["heartbeat_timeout_s"]), float(ft["heartbeat_hard_timeout_s"]),
            float(ft["node_timeout_s"]), launcher.node_of_slot.get)
        launcher.start(slots)
        if local:
            log(f"[deadpool] {len(launcher.agents)} node agent(s) started {n_workers} workers + "
                f"{cfg['ft']['num_spares']} warm spare(s); store on port {master.port}; run dir {run_dir}")
        else:  # srun starts one `python -m deadpool.agent --node-from-env` per node
            log(f"[deadpool] coordinator up; store {cfg['launcher']['host']}:{master.port}; waiting "
                f"for {len(launcher.nodes)} node agent(s) with {len(slots)} processes (job file "
                f"{job_json})")
    elif cfg["launcher"]["name"] == "local":
        launcher = LocalLauncher(run_dir, job_json, secret,
                                 share_gpu=bool(cfg["launcher"].get("share_gpu")))
        launcher.start(slots)
        log(f"[deadpool] {n_workers} workers + {cfg['ft']['num_spares']} warm spare(s) started; "
            f"store on port {master.port}; run dir {run_dir}")
    else:  # srun / torchrun start the processes: `python -m deadpool.rank.worker --job ... --slot $SLURM_PROCID`
        launcher = ExternalLauncher(store, secret)
        log(f"[deadpool] coordinator up; store {cfg['launcher']['host']}:{master.port}; waiting for "
            f"{len(slots)} processes (job file {job_json})")
    coord = Coordinator(cfg, store, launcher, log=log, secret=secret, restart=restart, live=live,
                        events=events, waker=waker, stopper=stop)
    stop.launcher, stop.waker, stop.running = launcher, waker, True

    def on_gone(node: int) -> None:  # (the presence thread) a node's agent died: so did its ranks
        if coord.outcome == "running":
            live.lose_node(node, launcher.slots_of_node(node))
            log(f"[coordinator] node {node}: its agent's connection ended (its processes are "
                "gone)")
            waker.woken.set()

    if presence is not None:
        presence.start()
    try:
        coord.run()
    except JobFailed as e:
        coord.outcome, coord.message = "failed", str(e)
        if isinstance(e, preempt.StoppedBeforeStart):
            coord.outcome = "preempted"
        for s in slots:
            launcher.kill(s)
    except HardStop as e:  # a second signal: its handler killed every local process
        coord.outcome, coord.message = "preempted", f"{e}; {disk.resume_hint(coord)}"
    finally:
        stop.running = False
        if presence is not None:
            presence.stop()
        if coord.outcome == "restart":  # torn down at once, as torchrun does: disk is what counts
            for s in slots:
                launcher.kill(s)
        # a stopped job's processes leave once written: the few that do not are killed sooner
        launcher.wait_all(timeout_s=30 if stop.why is None else 5)
        if stop.why is not None and isinstance(launcher, (LocalLauncher, AgentLauncher)) \
                and not isinstance(launcher, ExternalAgentLauncher):
            _wait_gone(run_dir)
    return coord, store


def _wait_gone(run_dir: Path, timeout_s: float = 5.0) -> None:
    """After a stop, the job's processes on this machine are gone before the job returns (a
    node's processes die with its agent, moments after it)."""
    deadline = time.monotonic() + timeout_s
    while job_processes(run_dir) and time.monotonic() < deadline:
        time.sleep(0.05)


def _clear(store) -> None:
    """Delete every key of a launch's namespace (the store outlives launches)."""
    try:
        for key in store.list_keys():
            store.delete_key(key)
    except Exception:  # a store that cannot list keys: they stay (the namespace is never reused)
        pass


def _relaunch_cfg(cfg: dict, store, first_generation: int, rec, log) -> dict:
    """The config of a relaunch: from the newest complete checkpoint (the original
    ``ft.resume_from`` if none was written), generations numbered on, without the faults that
    already fired (a relaunched process must not replay its predecessor's kill), and at the
    record's data-parallel width (an elastic shrink or regrow) with the global batch kept."""
    ft, par = cfg["ft"], dict(cfg["parallel"])
    resume = ft["checkpoint_dir"] if checkpoint.latest_complete_step(ft["checkpoint_dir"]) \
        is not None else ft["resume_from"]
    extra = {"_first_generation": first_generation}
    if rec.get("fallback") in ("shrink", "grow"):
        full = int(cfg.get("_full_dp") or par["dp"])
        par.update(dp=int(rec.dp), global_dp=int(par.get("global_dp") or par["dp"]))
        extra["_full_dp"] = full
        regrow = ft.get("elastic_regrow_after_s")
        # a time.monotonic() deadline: the relaunch's coordinator runs in this process
        extra["_grow_at"] = (time.monotonic() + float(regrow)
                             if rec.fallback == "shrink" and regrow is not None else None)
    dims = ParallelDims.from_config(par)
    world = dims.world_size
    want = int(cfg.get("_full_replicas") or ft.get("replicas", 1))
    extra["_full_replicas"] = want
    if want > max_replicas(dims):  # a shrink left too few nodes (ranks) for k
        log(f"[deadpool] ft.replicas={want} needs more nodes than dp {dims.dp} has: "
            f"{max_replicas(dims)} replica(s) per rank until the job regrows")
    ft = dict(ft, replicas=min(want, max_replicas(dims)))
    events = []
    for ev in cfg["faults"]["events"]:
        if store.check([FaultEvent.from_cfg(ev).key]):
            continue  # fired
        if (ev.get("rank") is not None and int(ev["rank"]) >= world) or \
                (ev.get("slot") is not None and int(ev["slot"]) >= world + int(ft["num_spares"])):
            log(f"[deadpool] fault {ev} names a rank or slot the narrower job has not: dropped")
            continue
        events.append(ev)
    return dict(cfg, ft=dict(ft, resume_from=resume), faults=dict(cfg["faults"], events=events),
                parallel=par, **extra)
