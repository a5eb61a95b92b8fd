"""GPU check 2: hot-swap with CUDA state, bitwise equal to a failure-free run of the same seed.

    python experiments/gpu/check_hotswap.py OUT_DIR [--device cuda] [--model small]
        [--steps 30] [--no-deterministic] [--name check_hotswap] [-- extra Hydra overrides]

Runs, as a user would::

    python -m deadpool.train experiment=cpu_hotswap device=cuda backend=gloo deterministic=true \\
        model=small ft.state_sources=[replica] hydra.run.dir=RUN

i.e. 4 workers + 1 warm spare sharing one GPU, gradient all-reduce on gloo over CUDA tensors
(NCCL refuses two ranks on one device), rank 1 SIGKILLed mid-step (after backward, before the
all-reduce); the spare restores the dead rank's CUDA state from its buddy's replica (peers are
excluded as sources so that the replica path is what is exercised); the entry point then re-runs
the same seed without faults and compares every rank's final state tensor by tensor
(``deadpool.launch.report.compare_final_states``, as tests/integration/test_hotswap.py does). This
script re-checks that comparison, samples nvidia-smi during the run (how many processes held a
CUDA context and how much memory), and writes OUT_DIR/<name>.json with the recovery breakdown.
``--no-deterministic`` is the control: the same without deterministic algorithms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, env_info, write_json  # noqa: E402

import torch  # noqa: E402


class GpuSampler(threading.Thread):
    """nvidia-smi every ``interval_s``: the most compute processes seen at once, peak memory."""

    def __init__(self, interval_s: float = 0.5):
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.stop = threading.Event()
        self.max_apps = 0
        self.max_total_mib = 0
        self.per_app_mib: list[int] = []
        self.samples = 0

    def run(self):
        while not self.stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                                      "--format=csv,noheader,nounits"], capture_output=True,
                                     text=True, timeout=10).stdout
                mibs = [int(line.split(",")[1]) for line in out.splitlines() if "," in line]
                self.samples += 1
                if len(mibs) >= self.max_apps:
                    self.max_apps, self.per_app_mib = len(mibs), mibs
                self.max_total_mib = max(self.max_total_mib, sum(mibs))
            except (OSError, subprocess.SubprocessError, ValueError):
                pass
            self.stop.wait(self.interval_s)


def tensor_compare(run_a: Path, run_b: Path) -> dict:
    """Per-rank count of tensors and bytes compared, and how many differ."""
    from deadpool.launch.report import final_ranks, load_final_rank

    out = {}
    for r in final_ranks(run_a):
        if r not in final_ranks(run_b):
            out[f"rank{r}"] = "missing in reference"
            continue
        sa, sb = load_final_rank(run_a, r), load_final_rank(run_b, r)
        differ = [k for k in sa if k not in sb or not torch.equal(sa[k], sb[k])]
        out[f"rank{r}"] = {"tensors": len(sa), "bytes": sum(t.numel() * t.element_size() for t in sa.values()),
                        "differ": len(differ), "first_differing": differ[:3]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="small")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--no-deterministic", action="store_true")
    ap.add_argument("--run-dir", default=None, help="where the job writes (default: a temp dir)")
    ap.add_argument("--timeout-s", type=float, default=400.0)
    ap.add_argument("--name", default="check_hotswap", help="output file stem")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    out_path = Path(args.out_dir) / f"{args.name}.json"
    res: dict = {"check": "hot-swap with CUDA state", "options": sys.argv[2:], "env": env_info()}
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        res["skipped"] = "needs a CUDA device"
        write_json(out_path, res)
        print(res["skipped"])
        return
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="deadpool-hotswap-"))
    det = not args.no_deterministic
    cmd = [sys.executable, "-m", "deadpool.train", "experiment=cpu_hotswap", f"device={args.device}",
           "backend=gloo", f"deterministic={'true' if det else 'false'}", f"model={args.model}",
           f"num_steps={args.steps}", "ft.state_sources=[replica]", *args.overrides,
           f"hydra.run.dir={run_dir}"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if det:
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    res["command"] = " ".join(["python", *cmd[1:]])
    print(res["command"], flush=True)
    sampler = GpuSampler() if args.device.startswith("cuda") else None
    if sampler:
        sampler.start()
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout_s)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = "timeout", (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), ""
    res["wall_s"] = time.perf_counter() - t0
    if sampler:
        sampler.stop.set()
        sampler.join(5)
        res["gpu_processes"] = {"max_concurrent": sampler.max_apps, "mib_each_at_max": sampler.per_app_mib,
                                "max_total_mib": sampler.max_total_mib, "samples": sampler.samples}
    res["returncode"] = rc
    res["stdout_tail"] = stdout[-4000:]
    res["stderr_tail"] = stderr[-2000:]
    verdict = [line for line in stdout.splitlines() if "final state vs failure-free" in line]
    res["entry_point_verdict"] = verdict[-1] if verdict else None
    ref_dir = run_dir / "reference_failure_free"
    for key, d in (("summary", run_dir), ("reference_summary", ref_dir)):
        f = d / "summary.json"
        if f.exists():
            res[key] = json.loads(f.read_text())
    if (run_dir / "final").exists() and (ref_dir / "final").exists():
        from deadpool.launch.report import compare_final_states

        equal, why = compare_final_states(run_dir, ref_dir)
        res["bitwise_equal"] = equal
        res["compare"] = why
        res["per_rank"] = tensor_compare(run_dir, ref_dir)
        s, r = res.get("summary", {}), res.get("reference_summary", {})
        res["same_final_digest"] = s.get("final_digest") is not None and \
            s.get("final_digest") == r.get("final_digest")
    recs = res.get("summary", {}).get("recoveries", [])
    if recs:
        keep = ("failed_rank", "fault", "detected_by", "spare_slot", "sources", "resume_step",
                "steps_recomputed", "detect_s", "plan_s", "rebuild_s", "transfer_s", "rollback_s",
                "first_step_s", "kill_to_training_s", "kill_to_first_step_s", "kill_to_protected_s",
                "bytes_transferred", "outcome")
        res["recovery"] = [{k: rec.get(k) for k in keep} for rec in recs]
    logs = sorted((run_dir / "logs").glob("slot*.log")) if (run_dir / "logs").exists() else []
    res["log_tails"] = {f.stem: f.read_text()[-800:] for f in logs if rc != 0}
    res["run_dir"] = str(run_dir)
    write_json(out_path, res)
    print(json.dumps({k: res.get(k) for k in ("returncode", "entry_point_verdict", "bitwise_equal",
                                              "compare", "recovery", "gpu_processes")}, indent=1))


if __name__ == "__main__":
    main()
