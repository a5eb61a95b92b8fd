"""``python -m deadpool.memory [--measured | --issue | --json <job overrides>]``: the memory
estimator's command line (``deadpool.launch.memory_tables``; the estimator is
``deadpool.launch.memory``)."""

from deadpool.launch.memory_tables import main

if __name__ == "__main__":
    main()
