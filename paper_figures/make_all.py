"""Regenerate every figure from the result files (no simulation is run); same as
``python -m paper_figures``.

    python paper_figures/make_all.py [--out DIR]
"""

import runpy
from pathlib import Path

if __name__ == "__main__":
    runpy.run_path(str(Path(__file__).resolve().parent / "__main__.py"), run_name="__main__")
