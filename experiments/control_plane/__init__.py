"""The control-plane benchmark's parts (``experiments/bench_control_plane.py`` is its command line
and describes what it measures).

    common.py          shared constants, the per-thread stats layout, counting store clients
    fake_ranks.py      ``--protocol old``: fake rank processes polling the store themselves
    fake_nodes.py      ``--protocol new``: fake nodes, each with a real ``NodeAgent`` and board
    coordinator_side.py  the real coordinator with a launcher stand-in, noting detections,
                       plans and each recovery's store requests
    measure.py         one size: start-up (with progress lines), steady state, exit, node loss
    table.py           the command line, ``table.csv`` and ``runs.json``
"""
