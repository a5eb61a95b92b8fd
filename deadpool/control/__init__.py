"""The control plane: the coordinator and what it alone does.

Owns the coordinator (``coordinator``: membership, plans, the main loop, with its store reads
in ``observe``), how it judges heartbeats and node records (``liveness``; node agents judge
their own processes with it too) and the drain requests it answers (``drain``); its recovery decisions live in
``deadpool.recovery`` (detect, plan, fallbacks, elastic, ...), the same layer. May import a
rank's process and the mechanisms below it; never the launch path above it (launch -> control
-> rank -> mechanisms).

Submodules are imported by name; this file imports none of them.
"""
