"""experiments/bench_control_plane.py at a tiny size, both protocols: the table has the issue's
columns, and what it measures is plausible (a silent node cannot be detected before its timeout;
an exit is seen within the coordinator's loop; the plan reaches every process)."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COLUMNS = ["ranks", "protocol", "store_ops_per_s_per_rank", "exit_detect_s", "node_detect_s",
           "plan_everywhere_s", "coordinator_cpu_frac"]


def test_the_benchmark_writes_the_table_at_a_tiny_size(tmp_path):
    p = subprocess.run(
        [sys.executable, "experiments/bench_control_plane.py", "--ranks", "16", "--duration-s",
         "2", "--ranks-per-node", "4", "--procs", "1", "--threads", "2", "--dilation", "0.5",
         "--out", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stdout + p.stderr
    with open(tmp_path / "table.csv") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames[:len(COLUMNS)] == COLUMNS
        new, row = list(reader)
    assert new["ranks"] == "16" and new["protocol"] == "new" and new["survived"] == "True"
    assert 0 < float(new["exit_detect_s"]) < 5
    # a silent node: its agent's record stops, seen after ft.node_timeout_s (3 s, dilated x 0.5
    # and reported undilated)
    assert 2.5 < float(new["node_detect_s"]) < 10  # (less at most one record interval)
    assert 0 < float(new["plan_everywhere_s"]) < 5
    assert row["ranks"] == "16" and row["protocol"] == "old" and row["dilation"] == "0.5"
    assert float(row["store_ops_per_s_per_rank"]) > 20  # ~95 per rank plus the spares' polling
    assert 0 < float(row["coordinator_cpu_frac"]) < 2
    assert 0 < float(row["exit_detect_s"]) < 5
    assert float(row["node_detect_s"]) > 1.0  # never before the soft heartbeat timeout
    assert 0 < float(row["plan_everywhere_s"]) < 5
    assert (tmp_path / "runs.json").exists()
