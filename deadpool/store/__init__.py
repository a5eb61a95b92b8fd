"""The store protocol: what the coordinator, the node agents and the ranks exchange through the
job's store.

Owns the keys and messages (``protocol``), a plan's wire form (``wire``), the job's secret and
the seals it puts on every value (``auth``), reading many per-rank reports in few round trips
(``reports``) and the agreements the ranks of a generation reach every few steps (``rounds``).
The contract between the layers, so it sits at the bottom beside the mechanisms: it may import
``deadpool.errors`` and ``deadpool.threads``, and nothing of launch, control or rank (launch ->
control -> rank -> mechanisms).

Submodules are imported by name; this file imports none of them.
"""
