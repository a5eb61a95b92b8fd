"""Helpers of the GPU checks that run ``deadpool.train`` jobs: start one bounded, stop it once its
last step is logged (its exit writes every rank's full state: 20 GB for gpt_1b, which outlasted
a 170 s bound on an H200), read its steps from the ranks' own metrics files (``metrics.jsonl``
is merged only at the end) and each rank's start-up breakdown from its slot log.

    python experiments/gpu/jobs.py WARM_JSON OVERRIDES...   # a job recording when each slot got warm

The second form runs the job as ``python -m deadpool.train`` does (the same composed config,
``deadpool.train.run``) and writes, as the coordinator reads them, the wall-clock times at
which each slot (rank or spare) reported itself warm (its join announcement) to WARM_JSON.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, write_json  # noqa: E402

STARTUP = re.compile(r"\[rank (\d+)\] start-up ([\d.]+) s: (.*)")


def metrics_rows(run_dir: Path, rank: int | None = 0) -> list[dict]:
    """Step rows (of ``rank``; all with None), by step: the merged file once written, else the
    slots' own files (a job still running, or stopped before its end)."""
    run_dir = Path(run_dir)
    files = [run_dir / "metrics.jsonl"] if (run_dir / "metrics.jsonl").exists() else \
        sorted((run_dir / "metrics").glob("slot*.jsonl"))
    rows = []
    for f in files:
        for line in f.read_text().splitlines():
            try:
                r = json.loads(line)
            except ValueError:  # a line being written
                continue
            if "step_time_s" in r and (rank is None or r.get("rank", 0) == rank):
                rows.append(r)
    return sorted(rows, key=lambda r: (r["step"], r.get("t", 0)))


def parse_startup(line: str | None) -> dict | None:
    """``[rank 0] start-up 3.2 s: imports 2.0, build 1.1 (stage 0.5, optimizer 0.0,
    snapshot_buffers 0.0), groups 0.0, state 0.0, first step 0.1`` -> {"rank": 0, "total_s": 3.2,
    "phases_s": {"imports": 2.0, ...}, "build_s": {"stage": 0.5, ...}}. The "build" phase runs
    from the end of the imports to the rank's stage built: it includes the wait for the
    coordinator's first plan (written once every slot, spares included, is warm);
    ``waiting_for_plan_s`` is that phase less its build detail."""
    m = STARTUP.search(line or "")
    if not m:
        return None
    rest, detail = m.group(3), {}
    d = re.search(r"\(([^)]*)\)", rest)
    if d:
        detail = {k.strip(): float(v) for k, v in (p.strip().rsplit(" ", 1) for p in d.group(1).split(","))}
        rest = rest.replace(d.group(0), "")
    phases = {k.strip(): float(v) for k, v in (p.strip().rsplit(" ", 1) for p in rest.split(",") if p.strip())}
    out = {"rank": int(m.group(1)), "total_s": float(m.group(2)), "phases_s": phases, "build_s": detail}
    if "build" in phases and detail:
        out["waiting_for_plan_s"] = round(phases["build"] - sum(detail.values()), 3)
    return out


def startup_lines(run_dir: Path) -> dict[int, str]:
    """rank -> its first start-up line, from the slot logs."""
    out: dict[int, str] = {}
    for f in sorted((Path(run_dir) / "logs").glob("slot*.log")):
        for line in f.read_text(errors="replace").splitlines():
            m = STARTUP.search(line)
            if m and int(m.group(1)) not in out:
                out[int(m.group(1))] = line[m.start():]
    return out


def stop_job(p: subprocess.Popen, run_dir: Path, wait_s: float = 30.0) -> dict:
    """SIGKILL the job's coordinator (its process group); its agents and their processes die
    with it (parent-death signals). Wait until no process names the job's file any more (the
    next arm must find the GPU and the pinned host memory free); SIGKILL any still there."""
    from deadpool.launch.launcher import job_processes

    t0 = time.monotonic()
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
    killed = 0
    while time.monotonic() - t0 < wait_s:
        left = [pid for pid in job_processes(run_dir) if pid != os.getpid()]
        if not left:
            break
        if time.monotonic() - t0 > 5:  # an orphan that outlived its agent: ours to end
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except ProcessLookupError:
                    pass
        time.sleep(0.2)
    return {"cleanup_s": round(time.monotonic() - t0, 2), "leftovers_killed": killed,
            "leftovers_remaining": len(job_processes(run_dir))}


def run_bounded(cmd: list[str], run_dir: Path, last_step: int, timeout_s: float,
                env: dict | None = None, hide: str | None = None) -> dict:
    """Run a job until rank 0 logged ``last_step`` (then stop it), it ends itself, or
    ``timeout_s`` passes (``timed_out``: whatever was logged by then is kept). Rows of every
    rank, rank 0's start-up, launch -> first step (the first row's wall-clock time: the end of
    step 1). ``hide``: a path replaced by TMP in what is returned."""
    run_dir = Path(run_dir)
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [x for x in [env.get("PYTHONPATH")] if x])
    t0 = time.time()
    reached = timed_out = False
    with tempfile.TemporaryFile("w+") as out:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True,
                             env=env, start_new_session=True)
        while p.poll() is None:
            rows = metrics_rows(run_dir)
            if rows and rows[-1]["step"] >= last_step:
                reached = True
                break
            if time.time() - t0 > timeout_s:
                timed_out = True
                break
            time.sleep(0.25)
        t_end = time.time()
        ended_itself = p.poll() is not None
        cleanup = stop_job(p, run_dir)
        out.seek(0)
        output = out.read()
    rows = metrics_rows(run_dir)
    lines = startup_lines(run_dir)
    scrub = (lambda s: s.replace(hide, "TMP")) if hide else (lambda s: s)
    return {"command": scrub(" ".join(["python", *cmd[1:]])),
            "returncode": p.returncode if ended_itself else None, "timed_out": timed_out,
            "stopped_after_last_step": reached, "wall_s": round(t_end - t0, 2), **cleanup,
            "t_launch": t0, "rows": rows,
            "launch_to_first_step_s": rows[0]["t"] - t0 if rows else None,
            "startup_line": lines.get(0), "startup": parse_startup(lines.get(0)),
            "startup_other_ranks": {r: parse_startup(v) for r, v in lines.items() if r != 0},
            "tail": scrub(output)[-3000:]}


def _record_warm(out_json: str, overrides: list[str]) -> int:
    """Run the job in this process (as ``python -m deadpool.train`` does), recording each
    slot's join announcement (its own wall-clock time at warm) as the coordinator reads it."""
    import deadpool.control.coordinator as coordinator
    from deadpool.launch.config import compose_config
    from deadpool.store.protocol import Keys
    from deadpool.train import run

    warm: dict[int, dict] = {}

    class Recording(coordinator.Reports):
        def poll(self):
            got = super().poll()
            if self.key_of == Keys.spare_ready and any(s not in warm for s in got):
                for s, text in got.items():
                    if s not in warm:
                        try:
                            warm[s] = {"t_warm": float(text), "t_seen": time.time()}
                        except ValueError:
                            warm[s] = {"text": text, "t_seen": time.time()}
                write_json(out_json, {str(k): v for k, v in warm.items()})
            return got

    coordinator.Reports = Recording
    run_dir = next((o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")), None)
    overrides = [o for o in overrides if not o.startswith("hydra.")]
    cfg = compose_config(overrides, run_dir or tempfile.mkdtemp())
    return run(cfg)


if __name__ == "__main__":
    sys.exit(_record_warm(sys.argv[1], sys.argv[2:]))
