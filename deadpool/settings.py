"""Settings derived from the resolved config, shared by the job, the coordinator and the ranks."""

from __future__ import annotations

import math


def layout_cfg(cfg: dict, layout: dict) -> dict:
    """``cfg`` (the job's configured one) at a generation's ``layout`` (``Plan.layout``: an
    in-place elastic width, ``recovery.elastic``; empty at the configured one)."""
    if not layout:
        return cfg
    par = dict(cfg["parallel"], dp=int(layout["dp"]), global_dp=int(layout["global_dp"]))
    return dict(cfg, parallel=par, ft=dict(cfg["ft"], replicas=int(layout["replicas"])))


BUBBLE_MAX = 0.1  # the idle share of 1F1B, (pp - 1) / (v m + pp - 1), that ``auto`` aims under


def bubble_microbatches(pp: int, virtual_stages: int = 1) -> int:
    """The fewest micro-batches keeping the (interleaved) 1F1B bubble ``(pp - 1) / (v m + pp -
    1)`` at most ``BUBBLE_MAX``: ``9 (pp - 1) / v`` rounded up (9 (pp - 1) without interleaving)."""
    return math.ceil((pp - 1) * (1 - BUBBLE_MAX) / BUBBLE_MAX / virtual_stages - 1e-9)


def bubble(pp: int, m: int, virtual_stages: int = 1) -> float:
    """The idle share of a 1F1B step, ``(pp - 1) / (v m + pp - 1)``: ``pp - 1`` chunk-slots of
    ramp-up and drain against ``v m`` of work (Megatron's ``(pp - 1) / (v m)`` is its ratio to
    the work, rather than its share of the step)."""
    return (pp - 1) / (virtual_stages * m + pp - 1)


def virtual_stages(cfg: dict) -> int:
    """``parallel.virtual_stages`` (interleaved 1F1B: model chunks per pipeline rank; default
    1), refused unless ``pp > 1`` and ``model.n_layers`` splits into ``pp * v`` equal chunks."""
    p = cfg["parallel"]
    v = int(p["virtual_stages"]) if p.get("virtual_stages") is not None else 1
    if v == 1:
        return 1
    pp, n_layers = int(p["pp"]), int(cfg["model"]["n_layers"])
    if v < 1 or pp < 2:
        raise ValueError(f"parallel.virtual_stages={v} needs parallel.pp >= 2 (got pp={pp}) "
                         "and v >= 1")
    if n_layers % (pp * v):
        raise ValueError(f"parallel.virtual_stages={v}: model.n_layers={n_layers} is not "
                         f"divisible by pp * virtual_stages = {pp * v} (equal model chunks)")
    return v


def num_microbatches(cfg: dict) -> int:
    """``parallel.microbatches``; ``auto`` (or null): 1 without pipelining; else the fewest
    micro-batches ``m`` dividing the batch size that keep 1F1B's bubble ``(pp - 1) / (m + pp - 1)``
    at most ``BUBBLE_MAX`` (``m >= 9 (pp - 1)``), or the whole batch, one sequence per
    micro-batch, when no divisor reaches it (1F1B keeps at most ``pp`` micro-batches' activations
    per stage whatever ``m`` is, so more, smaller micro-batches need no more memory).

    Interleaved (``virtual_stages`` v > 1): ``m`` must be a multiple of ``pp`` (refused
    otherwise); ``auto`` takes the fewest such divisors with ``(pp - 1) / (v m + pp - 1)`` within
    ``BUBBLE_MAX``, else the largest such divisor."""
    p = cfg["parallel"]
    mb = p.get("microbatches", "auto")
    v = virtual_stages(cfg)
    pp = int(p["pp"])
    if mb in (None, "auto"):
        batch = int(cfg["batch_size"])
        if pp == 1:
            return 1
        if v == 1:
            return next((m for m in range(bubble_microbatches(pp), batch + 1) if batch % m == 0),
                        batch)
        fits = [m for m in range(pp, batch + 1, pp) if batch % m == 0]
        if not fits:
            raise ValueError(f"parallel.virtual_stages={v}: no micro-batch count divides "
                             f"batch_size={batch} and is a multiple of pp={pp}")
        return next((m for m in fits if m >= bubble_microbatches(pp, v)), fits[-1])
    m = int(mb)
    if v > 1 and m % pp:
        raise ValueError(f"parallel.virtual_stages={v}: parallel.microbatches={m} must be a "
                         f"multiple of pp={pp} (interleaved 1F1B runs micro-batches in groups "
                         "of pp)")
    return m


def microbatch_note(cfg: dict) -> str | None:
    """The line a job prints when it chose the micro-batches itself (pipelined, ``auto``) or
    interleaves: the micro-batches and the bubble they leave."""
    p = cfg["parallel"]
    pp, v = int(p["pp"]), virtual_stages(cfg)
    auto = p.get("microbatches", "auto") in (None, "auto")
    if pp == 1 or not (auto or v > 1):
        return None
    m = num_microbatches(cfg)
    share = bubble(pp, m, v)
    need = -(-bubble_microbatches(pp, v) // pp) * pp if v > 1 else bubble_microbatches(pp)
    short = (f" (over {BUBBLE_MAX:.0%}: batch_size >= {need} would keep it "
             f"within {BUBBLE_MAX:.0%})") if auto and share > BUBBLE_MAX + 1e-9 else ""
    if v == 1:
        return (f"[deadpool] parallel.microbatches=auto: {m} per step at pp {pp} (batch_size "
                f"{cfg['batch_size']}): 1F1B bubble {share:.1%}{short}")
    return (f"[deadpool] parallel.microbatches={'auto' if auto else m}: {m} per step at pp {pp} "
            f"(batch_size {cfg['batch_size']}), interleaved 1F1B over {v} virtual stages: bubble "
            f"{share:.1%} of the step ((pp-1)/(v m) = {(pp - 1) / (v * m):.1%} of the work){short}")
