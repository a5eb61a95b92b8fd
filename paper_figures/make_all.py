"""Regenerate every figure from the result files under experiments/results/ (no simulation is run).

    python paper_figures/make_all.py [--out DIR]
"""

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "out"))
    a = ap.parse_args()
    failed = []
    for script in sorted(HERE.glob("fig*.py")):
        print(f"== {script.name}")
        if subprocess.run([sys.executable, str(script), "--out", a.out]).returncode:
            failed.append(script.name)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
