"""Node agents under Slurm without Slurm: the agent's node from the srun task's environment, its
children's environment, where its board lives, what the job body reads from job.json, and the
coordinator's launcher for agents it did not start."""

from __future__ import annotations

import signal

import pytest

from deadpool.agent.__main__ import SRUN_TASK_ENV, child_env, describe, node_dir, slurm_node
from deadpool.agent.board import NODE_INDEX_ENV
from deadpool.control.liveness import NodeLiveness
from deadpool.launch.job import uses_agents
from deadpool.launch.launcher import ExternalAgentLauncher
from deadpool.topology import node_slots, num_nodes


def _cfg(tmp_path, dp=16, spares=4, rpn=4, launcher="slurm", agents=True):
    return {"parallel": {"dp": dp, "tp": 1, "pp": 1, "ranks_per_node": rpn},
            "ft": {"num_spares": spares}, "run_dir": str(tmp_path / "run"),
            "launcher": {"name": launcher, "agents": agents}}


def test_the_node_is_the_srun_tasks_procid_else_its_node_id():
    assert slurm_node({"SLURM_PROCID": "3", "SLURM_NODEID": "0"}) == 3  # two agents on one machine
    assert slurm_node({"SLURM_NODEID": "2"}) == 2
    with pytest.raises(ValueError, match="SLURM_PROCID"):
        slurm_node({})


def test_a100_template_layout_one_agent_per_node_the_spares_on_the_last(tmp_path):
    cfg = _cfg(tmp_path)  # deadpool_a100.sbatch: 5 nodes of 4 GPUs, dp=16 + 4 spares
    assert num_nodes(cfg) == 5 and describe(cfg) == "1 5"
    assert node_slots(cfg, 0) == [0, 1, 2, 3] and node_slots(cfg, 4) == [16, 17, 18, 19]
    assert node_slots(cfg, 5) == []
    one = _cfg(tmp_path, dp=4, spares=1, rpn=5, agents=False)  # the local cluster's test job
    assert describe(one) == "0 1" and node_slots(one, 0) == [0, 1, 2, 3, 4]


def test_children_of_a_slurm_agent_get_their_device_and_not_the_agents_task():
    env = {"SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_TASK_PID": "77", "SLURM_GTIDS": "2",
           "SLURM_JOB_ID": "9", "LOCAL_RANK": "0", "PATH": "/bin"}
    kids = [child_env(env, i, external=True, num_devices=4) for i in range(5)]
    assert [k["LOCAL_RANK"] for k in kids] == ["0", "1", "2", "3", "0"]  # round-robin over the GPUs
    assert [k[NODE_INDEX_ENV] for k in kids] == ["0", "1", "2", "3", "4"]
    for k in kids:
        assert not any(name in k for name in SRUN_TASK_ENV)  # worker.main would read SLURM_LOCALID
        assert k["SLURM_JOB_ID"] == "9" and k["PATH"] == "/bin"
    assert child_env(env, 1, external=True, num_devices=0)["LOCAL_RANK"] == "0"  # CPU
    assert env["SLURM_PROCID"] == "2"  # the agent's own environment is untouched
    local = child_env({"PATH": "/bin"}, 1, external=False)
    assert local == {"PATH": "/bin", NODE_INDEX_ENV: "1"}  # start_worker sets LOCAL_RANK by slot


def test_the_board_is_node_local_and_apart_per_job_and_node(tmp_path):
    cfg = _cfg(tmp_path)
    a = node_dir(cfg, 0, {"SLURM_JOB_ID": "41"})
    assert "run" not in a.parts and str(tmp_path) not in str(a)  # never the (shared) run dir
    assert a.name == "node0" and a.parent.name.endswith("-j41")
    assert node_dir(cfg, 1, {"SLURM_JOB_ID": "41"}).parent == a.parent
    assert node_dir(cfg, 0, {"SLURM_JOB_ID": "42"}) != a
    assert not node_dir(cfg, 0, {}).parent.name.endswith("-j41")  # locally: no job id


def test_only_local_and_slurm_launchers_run_agents(tmp_path):
    assert uses_agents(_cfg(tmp_path)) and uses_agents(_cfg(tmp_path, launcher="local"))
    assert not uses_agents(_cfg(tmp_path, agents=False))
    assert not uses_agents(_cfg(tmp_path, launcher="torchrun"))


class Events:
    def __init__(self):
        self.pushed = []

    def push(self, kind, **data):
        self.pushed.append(dict(data, kind=kind))


class Clock:
    t = 100.0

    def __call__(self):
        return self.t


def test_external_agent_launcher_knows_nodes_fences_by_event_and_never_by_signal(tmp_path):
    cfg = _cfg(tmp_path, dp=4, spares=2, rpn=2)
    events, clock = Events(), Clock()
    launcher = ExternalAgentLauncher(tmp_path, tmp_path / "job.json", None, cfg, None, events)
    launcher.live = live = NodeLiveness(1.0, 10.0, 3.0, launcher.node_of_slot.get, clock=clock)
    launcher.start([0, 1, 2, 3, 4, 5])  # srun started them: nothing to do
    assert launcher.nodes == {0: [0, 1], 1: [2, 3], 2: [4, 5]} and launcher.slots_of_node(1) == [2, 3]
    for node in range(3):
        live.observe_node(node, "1 0 5 2 0")
    assert launcher.poll(1) is None and not launcher.is_stopped(1)  # no handle: never "gone"
    live.observe_node(0, '2 0 5 2 0 {"exit":{"1":-9}}')  # its agent saw rank 1 die
    assert launcher.poll(1) == -signal.SIGKILL
    clock.t += 3.5  # node 1's agent falls silent (dead or cut off): its ranks are lost
    live.observe_node(0, "3 0 6 2 0")
    assert live.beat_lost(2, launcher.is_stopped) and not live.beat_lost(0, launcher.is_stopped)
    launcher.fence([2, 3])
    launcher.kill(2)  # already fenced: no second event
    launcher.kill_node(1)  # no handle on a remote agent: nothing happens
    assert events.pushed == [{"slots": [2, 3], "kind": "fence"}]
    launcher.wait_all(timeout_s=0.1)


def test_an_abort_for_failed_ranks_is_one_event_that_carries_their_fence(tmp_path):
    """Under node agents the abort and the fence of the ranks it is for go out as one event (each
    event costs every agent a wake-up); an abort with nothing left to fence still goes out."""
    from types import SimpleNamespace

    from deadpool.control.coordinator import Coordinator
    from deadpool.store.protocol import Keys, Seal

    cfg = _cfg(tmp_path, dp=4, spares=2, rpn=2)
    events = Events()
    launcher = ExternalAgentLauncher(tmp_path, tmp_path / "job.json", None, cfg, None, events)
    written = {}
    coord = SimpleNamespace(store=SimpleNamespace(set=written.__setitem__, check=lambda k: False),
                            seal=Seal(None), gen=3, events=events, launcher=launcher)
    Coordinator.announce_abort(coord, "rank 1 failed", fence=[1])
    assert events.pushed == [{"g": 3, "slots": [1], "kind": "abort"}]
    assert Keys(3).abort in written and launcher.fenced == {1}
    coord.gen = 4
    Coordinator.announce_abort(coord, "again", fence=[1, 2])  # 1 is fenced already
    Coordinator.announce_abort(coord, "a stop")  # nothing to fence
    assert events.pushed[1:] == [{"g": 4, "slots": [2], "kind": "abort"}, {"g": 4, "kind": "abort"}]
