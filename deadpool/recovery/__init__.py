"""How a recovery flows: a failure in generation g, detected, planned, rebuilt, resumed in g+1.

Survivors keep their processes throughout; a warm spare takes each dead rank. Read the steps
in this order (``module:function``)::

    coordinator side                  (control/coordinator.py: Coordinator.run -> .recover)
    1 detect    recovery.detect:failures          a process exited, stopped beating, hung, or a
                                                  rank reported a broken collective
                recovery.detect:name_culprit      only a collective broke: wait briefly for a name
    2 abort     recovery.detect:abort_and_fence   set g/abort (every rank leaves its wait within
                                                  one poll), SIGKILL the dead
    3 collect   recovery.detect:collect_statuses  every process that answers says what it holds
                                                  (a RankStatus); the silent are declared dead
                recovery.detect:collect_bad_sources, collect_faults
    4 plan      recovery.plan:decide              newest step every rank can reach, and a Source
                                                  per rank (live, local, peer, replica, init)
                recovery.plan:assign_spares       a warm spare for each rank without a process
                                                  (a lost node's ranks together on one node)
                recovery.plan:groups_to_keep      the groups survivors may keep (gloo)
    5 fallback  recovery.fallbacks:*, disk:*      no copy in memory -> disk; no spare ->
                                                  ft.on_no_spare; no progress -> write and stop
    6 publish   Coordinator.write_plan            plan g+1, sealed, under plan/<g+1>

    worker side                       (rank/worker.py: Worker.run -> .run_generation)
    7 report    recovery.restore:report_status    on Aborted: park the communicator, write status
    8 rebuild   rank.comm:Communicator.build      the groups of g+1 (clean ones kept)
    9 restore   recovery.restore:restore          transfer / roll back / load per the Source
                snapshot.transfer:transfer        the bytes, checked against their checksums
   10 resume    rank.trainer:Trainer.train        replication restarts, the first step

    coordinator again
   11 account   recovery.timeline:finish_pending  RankTimings -> the RecoveryRecord's breakdown

A failure during any of steps 7-10 aborts g+1 the same way; step 1 then plans g+2 from what is
left (the open record is closed as interrupted). A stop on a signal (walltime, preemption,
Ctrl-C: ``recovery.preempt``) runs steps 2-4 without a failure and writes the planned step to
disk. A planned swap (a straggler, a drained node: ``recovery.migrate``) holds every rank at
one step boundary (``recovery.pause``) and runs steps 2-6 without a failure. The end of a job (every rank's final record, waited for while its writer progresses):
``recovery.finish``. Messages and store keys: ``deadpool.store.protocol``.
"""
