"""Re-cutting ZeRO-1 state for another data-parallel width (an elastic job that shrinks or
regrows loads a checkpoint written at the old width). Pure tensor arithmetic over the states a
checkpoint holds, named as ``ZeroOptimizer.state_tensors`` names them; no process group.
"""

from __future__ import annotations

import torch


def _padded(numel: int, dp_size: int) -> int:
    return -(-numel // dp_size) * dp_size


def reshard_state(old: list[dict[str, torch.Tensor]], numel: int, dp_size: int, dp_rank: int,
                  shard: bool) -> dict[str, torch.Tensor]:
    """The state (``state_tensors`` names) of data-parallel rank ``dp_rank`` of ``dp_size`` from
    the states of every data-parallel rank of the same stage written at another width, in their
    dp order (``old``; a rank written from a sharded replica may lack ``params``). AdamW's
    moments are elementwise, so re-cutting the concatenated shards is exact: concatenate the old
    shards (or take a whole copy), drop the old padding, pad for the new width, cut this rank's
    shard. Used when an elastic job changes its data-parallel width."""
    def full(name):
        if _sharded(old, name, numel):
            return torch.cat([st[name].reshape(-1) for st in old])[:numel]
        return old[0][name].reshape(-1)[:numel]

    def cut(t, keep_all):
        padded = torch.zeros(_padded(numel, dp_size), dtype=t.dtype)
        padded[:numel] = t
        if keep_all:
            return padded
        n = padded.numel() // dp_size
        return padded[dp_rank * n:(dp_rank + 1) * n].clone()

    params = next(st["params"] for st in old if "params" in st)
    out = {"params": cut(params.reshape(-1)[:numel], True)}
    if params.dtype != torch.float32 or shard:  # the names ZeroOptimizer.state_tensors gives
        # an fp32 master is the parameters' own slice (absent where the old width kept none)
        out["master"] = cut(full("master") if "master" in old[0]
                            else params.reshape(-1)[:numel].float(), not shard)
    for name in ("exp_avg", "exp_avg_sq"):
        out[name] = cut(full(name), not shard)
    out["step"] = old[0]["step"].clone()
    return out


def _sharded(old, name, numel) -> bool:
    """The old states hold ``name`` as shards (several ranks, each less than the whole)."""
    return len(old) > 1 and old[0][name].numel() < numel
