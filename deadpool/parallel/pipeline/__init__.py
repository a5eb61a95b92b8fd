"""Pipeline parallelism: 1F1B (``schedule.run_1f1b``) over the 2-rank stage groups, and its
interleaved variant (``interleaved.py``) when ``parallel.virtual_stages`` v > 1.

The micro-batches per step default to the fewest keeping the bubble ``(pp - 1) / (v m + pp - 1)``
at most 10 % as far as the batch allows (``deadpool.settings.num_microbatches``).

Interleaved 1F1B is Megatron's: each rank holds v non-contiguous chunks of layers (chunk ``c`` of
rank ``s`` is model chunk ``c * pp + s``: ``topology.layer_chunks``, ``stage.StageModel``), the
last rank hands activations back to rank 0 over a wrap-around pair of groups
(``groups.wrap_pair``), and ``m`` must be a multiple of ``pp``. Parameter names stay the
single-process model's, so snapshots, replicas and hot swaps carry chunked stages unchanged;
checkpoints record v in their layout and are re-laid out across it (``checkpoint.relayout``),
and export consolidates them (``export.consolidate``). Losses and gradients are bitwise 1F1B's on
the same micro-batches. ``p2p.py`` holds the point-to-point messages both schedules use.

``deadpool.launch.memory`` counts the chunks in flight at each rank's peak (``interleaved.in_flight``:
up to ``(pp - 1) * 2 + (v - 1) * pp + 1`` chunk-sized micro-batches on rank 0, about
``1 + (pp - 1) / (v pp)`` times 1F1B's ``pp`` stage-sized ones). Not done: the simulator knows no v.
"""

from deadpool.parallel.pipeline.schedule import run_1f1b  # noqa: F401
