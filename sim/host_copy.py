"""The host side of one snapshot: how long its device-to-host copy and its checksum take.

Shared by ``sim.network`` (whether the copy fits its overlap window, what the checksum adds to
the interval) and ``sim.overhead`` (the failure-free cost by part); imports neither.
"""

from __future__ import annotations

from typing import Mapping

from sim.layout import Layout


def overlap_window_s(layout: Layout, c: Mapping) -> float:
    """Time a snapshot's copy may take without blocking the next optimizer step."""
    return float(c.get("snapshot_overlap_frac", 1.0)) * layout.step_time_s


def host_bytes_per_node(layout: Layout, replicated_bytes_per_node: float) -> float:
    """Host-memory traffic of one snapshot on one node: the copies written, hashed (read) and
    the replication sent (read) and received (written: the ward's replica)."""
    local = layout.state_bytes_per_gpu * layout.gpus_per_node
    return 2.0 * local + 2.0 * replicated_bytes_per_node


def copy_s(layout: Layout, c: Mapping, replicated_bytes_per_node: float = 0.0) -> float:
    """Device-to-host copy of one snapshot: per GPU at ``host_copy_gbps_per_gpu``, but no faster
    than the node's host memory (``host_mem_gbps_per_node``, when given) carries every GPU's
    copy plus hashing and replication."""
    t = layout.state_bytes_per_gpu / (float(c["host_copy_gbps_per_gpu"]) * 1e9)
    mem = c.get("host_mem_gbps_per_node")
    if mem:
        t = max(t, host_bytes_per_node(layout, replicated_bytes_per_node) / (float(mem) * 1e9))
    return t


def checksum_s(layout: Layout, c: Mapping) -> float:
    """One rank hashing its whole snapshot (both regions: the runtime checks each)."""
    g = c.get("checksum_gbps")
    return layout.state_bytes_per_gpu / (float(g) * 1e9) if g else 0.0
