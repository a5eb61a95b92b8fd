"""A rank's process: one training process, or a warm spare waiting to become one.

Owns the worker (``worker``: a spare's wait, a rank's generations, coordinator loss), the
training loop (``trainer``), the communicator of a generation (``comm``, with its abort side in
``abort`` and its op-counting groups in ``counted``), the groups a rank belongs to, its
heartbeat and progress counter (``watchdog``; judged by ``deadpool.control.liveness``), fault
injection, and the per-step parts of the loop (evaluation, learning rate, precision,
throughput, TensorBoard, stragglers' compute clock).
May import the mechanisms below it (parallel, snapshot, checkpoint, data, export, the store
protocol); never the control plane or the launch path above it (launch -> control -> rank ->
mechanisms).

Submodules are imported by name; this file imports none of them.
"""
