"""The NCCL environment every worker runs with (deadpool/rank/nccl_env.py)."""

from deadpool.rank.nccl_env import nccl_env


def test_torch_error_handling_is_off_and_a_users_conflicting_value_is_overridden_loudly():
    env, warnings = nccl_env(False, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "0"  # survivors must not be torn down
    assert env["TORCH_NCCL_BLOCKING_WAIT"] == "0"  # waits are stream waits
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "0" and env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    assert len(warnings) == 1 and "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in warnings[0]
    assert nccl_env(False, {})[1] == []


def test_eager_connection_is_the_default_and_a_user_may_change_it():
    assert nccl_env(False, {})[0]["NCCL_RUNTIME_CONNECT"] == "0"
    assert nccl_env(False, {"NCCL_RUNTIME_CONNECT": "1"})[0]["NCCL_RUNTIME_CONNECT"] == "1"


def test_deterministic_runs_pin_the_algorithm_and_protocol():
    env, _ = nccl_env(True, {})
    assert (env["NCCL_ALGO"], env["NCCL_PROTO"]) == ("Ring", "Simple")
    assert "NCCL_ALGO" not in nccl_env(False, {})[0]
    _, warnings = nccl_env(True, {"NCCL_ALGO": "Tree"})
    assert any("NCCL_ALGO=Tree" in w for w in warnings)
