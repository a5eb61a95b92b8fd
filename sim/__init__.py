"""DeadPool simulator: goodput of hot-swap training at 10k-100k GPUs under failure traces.

The simulator replays one seeded failure trace per seed against every strategy (common random
numbers) in a SimPy discrete-event model whose event count grows with failures, not with
training steps. Entry points: ``python -m sim.run`` (Hydra, sim/conf/sim.yaml),
``python -m sim.calibrate`` (fit parameters from runtime outputs) and ``python -m sim.collect``
(gather a multirun into one tidy CSV for paper_figures).
"""
