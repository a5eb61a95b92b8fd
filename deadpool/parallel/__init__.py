"""Model parallelism, one folder per axis: ``tensor/`` (Megatron-style layers and the TP group's
ops), ``pipeline/`` (1F1B schedule over 2-rank stage groups), ``data/`` (ZeRO-1 optimizer and the
data-parallel group's ops), and ``grad_norm.py``, the one computation over all three axes (the
global gradient norm for clipping). Every layer and schedule takes the generation's ``Communicator``
explicitly: recovery replaces it, so nothing here keeps a process group of its own."""
