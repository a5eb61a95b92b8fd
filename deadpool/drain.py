"""``python -m deadpool.drain RUN_DIR --node N [--timeout-s 60]``: drain a node of a running job
(``deadpool.control.drain``)."""

import sys

from deadpool.control.drain import main

if __name__ == "__main__":
    sys.exit(main())
