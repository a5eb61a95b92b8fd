"""Validation loss (``eval_every_steps``, ``eval_batches``): the held-out split under no_grad.

Every rank of the job evaluates at the same steps, after the optimizer step (the pipeline and
tensor-parallel collectives need all of them). Data-parallel rank ``d`` of ``dp`` takes
validation batches ``k = d, d + dp, ...`` of ``eval_batches``; the last stage sums its batches'
mean losses and their count over the data-parallel group, so every last-stage rank ends with
the mean over all ``eval_batches``. Nothing of the training state moves: parameters are only
read, no gradient is made, the CPU RNG is restored afterwards, and the data position is the step
number, which evaluation does not change. So a run's final state is bitwise the same with
evaluation on or off (tested).
"""

from __future__ import annotations

import torch

from deadpool.parallel.pipeline.schedule import run_forward


def evaluate(trainer, comm) -> float | None:
    """Mean validation loss over ``eval_batches`` batches on the last stage, None elsewhere."""
    cfg = trainer.cfg
    dp_rank, dp = comm.topo.coords["dp"], comm.topo.dims.dp
    total, count = 0.0, 0
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        for k in range(dp_rank, int(cfg["eval_batches"]), dp):
            trainer.progress.set(trainer.step, "eval")  # each batch is progress (watchdog)
            x, y = trainer.corpus.eval_batch(k, int(cfg["batch_size"]), int(cfg["seq_len"]))
            loss = run_forward(trainer.stage, comm, x.to(trainer.device), y.to(trainer.device),
                               trainer.microbatches, act_dtype=trainer.dtype)
            if loss is not None:
                total, count = total + loss, count + 1
    if not trainer.stage.is_last:
        return None
    if dp > 1:  # on the device: NCCL reduces device tensors only
        t = torch.tensor([total, float(count)], dtype=torch.float64, device=trainer.device)
        comm.allreduce(t, "dp")
        total, count = t.tolist()
    return total / count if count else None
