"""Helpers shared by the GPU checks: environment record, JSON output, GPU memory readings.

    python experiments/gpu/common.py OUT.json     # write the environment record alone
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _smi(*args: str) -> str | None:
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True,
                              timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def env_info() -> dict:
    """GPU model, driver, torch/CUDA/NCCL versions, date: stored with every result."""
    import torch

    info = {
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "host_mem_total_gib": round(meminfo()["MemTotal"] / 2**30, 1) if meminfo() else None,
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpu_mem_gib=round(p.total_memory / 2**30, 1),
                    sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
        try:
            info["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception as e:  # noqa: BLE001 - a record, not a requirement
            info["nccl"] = f"unknown ({e})"
        q = _smi("--query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max",
                 "--format=csv,noheader")
        if q:
            f = [x.strip() for x in q.splitlines()[0].split(",")]
            info.update(driver=f[1], smi_name=f[0], smi_mem_total=f[2],
                        pcie_gen_max=f[3] if len(f) > 3 else None,
                        pcie_width_max=f[4] if len(f) > 4 else None)
    return info


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (Linux); {} elsewhere."""
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            parts = v.split()
            out[k] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    except OSError:
        pass
    return out


def proc_status() -> dict[str, int]:
    """VmRSS / VmLck / VmPin of this process in bytes."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            k, v = line.split(":", 1)
            if k in ("VmRSS", "VmLck", "VmPin", "VmSize", "Threads"):
                parts = v.split()
                out[k] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    except OSError:
        pass
    return out


def gpu_used_by_pid(pid: int | None = None) -> dict:
    """GPU memory nvidia-smi attributes to ``pid`` (MiB) and to all processes, and the device's
    used memory; None where nvidia-smi does not say."""
    pid = os.getpid() if pid is None else pid
    apps = _smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
    mine, total, n = None, 0, 0
    if apps:
        for line in apps.splitlines():
            try:
                p, m = (int(x.strip()) for x in line.split(","))
            except ValueError:
                continue
            n += 1
            total += m
            if p == pid:
                mine = m
    used = _smi("--query-gpu=memory.used", "--format=csv,noheader,nounits")
    return {"smi_pid_mib": mine, "smi_apps_mib": total if apps is not None else None,
            "smi_apps": n if apps is not None else None,
            "smi_device_used_mib": int(used.splitlines()[0]) if used else None}


def write_json(path: str | Path, obj: dict) -> None:
    """Write atomically (a check killed mid-write leaves the previous version)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


if __name__ == "__main__":
    rec = env_info()
    if len(sys.argv) > 1:
        write_json(sys.argv[1], rec)
    print(json.dumps(rec, indent=1))
