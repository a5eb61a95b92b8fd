"""Draw every figure from result files: ``python -m paper_figures [--out DIR] [--only fig01 ...]``.

Each ``fig*.py`` runs as its own process (they import the sibling ``style`` module); results are
read from ``experiments/results/`` or from ``$DEADPOOL_RESULTS`` when set (``make reproduce``).
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def run_all(out: str, only: list[str] | None = None) -> list[str]:
    scripts = [s for s in sorted(HERE.glob("fig*.py")) if not only or any(s.name.startswith(o) for o in only)]
    failed, t_all = [], time.time()
    for i, script in enumerate(scripts, 1):
        t0 = time.time()
        rc = subprocess.run([sys.executable, str(script), "--out", out]).returncode
        print(f"[figures] {i}/{len(scripts)} {script.stem}: {'ok' if rc == 0 else 'FAILED'} "
              f"({time.time() - t0:.1f} s)", flush=True)
        if rc:
            failed.append(script.name)
    print(f"[figures] {len(scripts) - len(failed)}/{len(scripts)} figures in {time.time() - t_all:.1f} s -> {out}")
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m paper_figures", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--only", nargs="*", help="figure name prefixes, e.g. fig01 fig09")
    a = ap.parse_args()
    failed = run_all(a.out, a.only)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
