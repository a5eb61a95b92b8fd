"""The job scenarios of ``check_nccl_multirank.py`` (S3, S4, S5): ``python -m deadpool.train`` on
NCCL with several ranks sharing one GPU (``launcher.share_gpu=true``: a ``NCCL_HOSTID`` per
process), a fault, and the final state compared bitwise (``torch.equal``) with a failure-free
run of the same seed (``verify_against_failure_free=true``: the job re-runs itself).

S3  dp4 + 1 spare, rank 1 killed inside the gradient all-reduce.
S4  dp2 x tp2 x pp2 + 1 spare, a TP peer (rank 1) killed in forward.
S5  dp2 x tp2 x pp2 on nodes of two ranks (``parallel.ranks_per_node=2``: nodes 0-3 hold ranks
    (0 1) (2 3) (4 5) (6 7), node 4 the two spares, slots 8 and 9), and node 1 lost: rank 2's
    ``kill_node`` fault in forward of step 6 SIGKILLs its node agent, then itself; rank 3 dies
    with its agent. Both ranks of the node die at once; expected: one recovery of both, swapped
    in as a block onto the spares' node (``ft.spare_policy=same_node_first``), bitwise equal.

Each job runs in a temporary directory (its ``final/`` states and logs stay out of OUT_DIR),
bounded by ``--job-timeout-s`` (the failure-free re-run included): the coordinator's process
group is killed, and with it its agents and their processes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import ROOT
from jobs import metrics_rows, stop_job

JOBS = ("S3", "S4", "S5")
S5_NODE = (2, 3)  # the ranks of node 1


def job_overrides(name: str, steps: int, device: str = "cuda") -> list[str]:
    """``device=cpu``: the same job on gloo (a smoke run of the scenario's machinery)."""
    where = (["device=cuda", "backend=nccl", "launcher.share_gpu=true"] if device == "cuda" else
             ["device=cpu", "backend=gloo", "launcher.share_gpu=false"])
    common = [f"num_steps={steps}", "model=tiny", *where, "deterministic=true",
              f"ft.num_spares={2 if name == 'S5' else 1}",
              "verify_against_failure_free=true", "log_every_steps=5"]
    if name == "S3":
        return ["parallel=dp4", *common,
                "faults.events=[{rank:1,step:8,phase:allreduce,kind:kill}]"]
    if name == "S4":
        return ["parallel=dp2_tp2_pp2", *common,
                "faults.events=[{rank:1,step:6,phase:forward,kind:kill}]"]
    return ["parallel=dp2_tp2_pp2", "parallel.ranks_per_node=2", "launcher.agents=true", *common,
            "ft.spare_policy=same_node_first",
            f"faults.events=[{{rank:{S5_NODE[0]},step:6,phase:forward,kind:kill_node}}]"]


def dry_run(name: str, steps: int, out_dir: Path) -> dict:
    from deadpool.launch.config import compose_config
    from deadpool.topology import ParallelDims, node_slots, num_nodes

    cfg = compose_config(job_overrides(name, steps), Path(out_dir) / "dry")
    assert cfg["backend"] == "nccl" and cfg["launcher"]["share_gpu"]
    p = cfg["parallel"]
    plan = {"overrides": job_overrides(name, steps), "faults": cfg["faults"]["events"],
            "parallel": {k: p[k] for k in ("dp", "tp", "pp")}}
    if name == "S5":  # the node layout as the node agents lay it out
        dims = ParallelDims.from_config(p)
        nodes = {n: node_slots(cfg, n) for n in range(num_nodes(cfg))}
        world, spares, rpn = dims.world_size, cfg["ft"]["num_spares"], dims.ranks_per_node
        killed = nodes[dims.node_of(S5_NODE[0])]
        assert killed == list(S5_NODE), (killed, nodes)
        assert spares >= rpn and nodes[max(nodes)] == list(range(world, world + spares)), nodes
        assert cfg["launcher"]["agents"] and cfg["faults"]["events"][0]["kind"] == "kill_node"
        plan.update(ranks_per_node=rpn, slots_by_node=nodes, killed_node_slots=killed,
                    spare_node_slots=nodes[max(nodes)], spare_policy=cfg["ft"]["spare_policy"])
    return plan


def final_slots(run_dir: Path) -> dict[int, int]:
    """rank -> the slot of its newest training step."""
    newest: dict[int, tuple[int, int]] = {}
    for m in metrics_rows(run_dir, rank=None):
        newest[m["rank"]] = max(newest.get(m["rank"], (-1, -1)), (m["step"], m["slot"]))
    return {r: slot for r, (_, slot) in newest.items()}


def block_swap(res: dict, run_dir: Path, rpn: int = 2) -> dict:
    """S5: one recovery, of both ranks of the node, each to a spare, all on one (spare) node."""
    recs = res.get("recovery") or []
    failed = [set(r["failed_rank"] if isinstance(r["failed_rank"], list) else [r["failed_rank"]])
              for r in recs]
    slots = final_slots(run_dir)
    new = {r: slots.get(r) for r in S5_NODE}
    one = len(recs) == 1 and failed[0] == set(S5_NODE) and recs[0].get("outcome") == "hot-swapped"
    same_node = None not in new.values() and len({s // rpn for s in new.values()}) == 1 \
        and all(s >= 8 for s in new.values())
    return {"recoveries": len(recs), "failed_ranks": [sorted(f) for f in failed],
            "final_slots_of_node_ranks": new, "one_recovery_of_the_node": one,
            "swapped_in_as_a_block": bool(one and same_node)}


def run_job(name: str, args, out_dir: Path) -> dict:
    from check_hotswap import tensor_compare

    from deadpool.launch.report import compare_final_states

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / f"run_{name.lower()}"
        cmd = [sys.executable, "-m", "deadpool.train",
               *job_overrides(name, args.steps, getattr(args, "device", "cuda")),
               f"hydra.run.dir={run_dir}"]
        env = dict(os.environ, PYTHONUNBUFFERED="1", CUBLAS_WORKSPACE_CONFIG=":4096:8")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [x for x in [env.get("PYTHONPATH")] if x])
        t0 = time.perf_counter()
        with tempfile.TemporaryFile("w+") as log:
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True)
            try:
                rc = p.wait(timeout=args.job_timeout_s)
            except subprocess.TimeoutExpired:
                rc = "timeout"
            cleanup = stop_job(p, run_dir)
            log.seek(0)
            stdout = log.read().replace(tmp, "TMP")
        res = {"command": " ".join(["python", *cmd[1:-1]]), "returncode": rc,
               "wall_s": time.perf_counter() - t0, **cleanup, "stdout_tail": stdout[-3000:]}
        ref = run_dir / "reference_failure_free"
        if (run_dir / "final").exists() and (ref / "final").exists():
            res["bitwise_equal"], res["compare"] = compare_final_states(run_dir, ref)
            res["per_rank"] = tensor_compare(run_dir, ref)
        summary = run_dir / "summary.json"
        if summary.exists():
            recs = json.loads(summary.read_text()).get("recoveries", [])
            res["recovery"] = [{k: r.get(k) for k in ("failed_rank", "fault", "detected_by", "sources",
                                                       "resume_step", "detect_s", "rebuild_s",
                                                       "transfer_s", "kill_to_first_step_s", "outcome")}
                               for r in recs]
        if name == "S5":
            res["node_loss"] = block_swap(res, run_dir)
            res["passed"] = bool(res["node_loss"]["swapped_in_as_a_block"] and res.get("bitwise_equal"))
    return res
