"""Pipeline parallelism: the 1F1B schedule (``schedule.run_1f1b``) over the 2-rank stage groups."""

from deadpool.parallel.pipeline.schedule import run_1f1b  # noqa: F401
