"""DeadPool: resilient LLM training with warm-spare hot-swapping and replicated in-memory snapshots.

Packages by role; imports run one way, launch -> control -> rank -> mechanisms:

- ``train``        the Hydra entry point (``python -m deadpool.train``)
- ``launch``       the job's process, launchers, run directory, memory estimator, signal stops
- ``agent``        one node agent per node: the parent of its ranks
- ``control``      the coordinator: store, membership, failure detection, the hot-swap plan;
                   ``recovery`` holds the steps of a recovery
- ``rank``         a training or spare process (``worker``), its step loop (``trainer``) and the
                   one object that owns every process group of a generation (``comm``)
- ``store``        keys, messages and seals exchanged through the job's store
- ``snapshot``, ``checkpoint``, ``parallel``, ``data``, ``export``: the mechanisms; beside them
  ``topology`` (parallel degrees, rank coordinates, buddy placement), ``model``, ``policies``
"""

__version__ = "0.1.0"
