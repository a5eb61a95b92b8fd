"""DeadPool: resilient LLM training with warm-spare hot-swapping and replicated in-memory snapshots.

The runtime is split into small parts that recovery can replace independently:

- ``topology``     parallel degrees, rank coordinates, buddy placement
- ``comm``         the one object that owns every process group of a generation
- ``snapshot``     per-step asynchronous snapshot + replication to a buddy rank
- ``coordinator``  store, membership, failure detection and the hot-swap plan
- ``worker``       a training or spare process; ``trainer`` is its step loop
- ``train``        the Hydra entry point (``python -m deadpool.train``)
"""

__version__ = "0.1.0"
