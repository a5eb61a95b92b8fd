"""Tensor parallelism (Megatron-style): ``ops`` (the TP group's autograd functions) and ``layers``
(column/row-parallel linears, vocabulary-parallel embedding, attention and SwiGLU split over tp)."""

from deadpool.parallel.tensor.layers import (ColumnParallelLinear, ParallelAttention,  # noqa: F401
                                             ParallelBlock, ParallelSwiGLU, RowParallelLinear,
                                             VocabParallelEmbedding, shard, unshard)
from deadpool.parallel.tensor.ops import (copy_to_tp, reduce_from_tp, tp_size,  # noqa: F401
                                          vocab_parallel_cross_entropy)
