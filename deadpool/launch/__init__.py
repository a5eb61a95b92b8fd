"""Launch: everything that starts a job and its processes, above the control plane.

Owns the job's own process (``job``: validation, store, coordinator, outputs), the launchers
and what starts one process (``procs``; ``zygote``: node agents forked from one interpreter), the run directory, the resolved config, the memory
estimator, signal stops and the run summary. May import the control plane, a rank's process and
the mechanisms below them (launch -> control -> rank -> mechanisms); nothing below imports it,
except the node agent, which is launch too (``deadpool.agent``).

Submodules are imported by name; this file imports none of them.
"""
