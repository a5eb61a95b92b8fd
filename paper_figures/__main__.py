"""Draw every figure from result files: ``python -m paper_figures [--out DIR] [--only fig01 ...]``.

Each ``fig*.py`` is a script (it imports the sibling ``style`` module and reads ``--input``/``--out``);
here they run one after another in this process, as ``__main__`` with their own ``sys.argv``, so
matplotlib and pandas are imported once (``--subprocess``: one process per figure instead). A figure
that raises is reported and the others still run; the exit status names the failures. Results are
read from ``experiments/results/`` or from ``$DEADPOOL_RESULTS`` when set (``make reproduce``).
"""

import argparse
import runpy
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent


def scripts(only: list[str] | None = None) -> list[Path]:
    return [s for s in sorted(HERE.glob("fig*.py")) if not only or any(s.name.startswith(o) for o in only)]


def run_one(script: Path, out: str) -> bool:
    """Run one figure script as ``__main__`` in this process; True when it finished."""
    import matplotlib.pyplot as plt

    import style  # noqa: F401  (the scripts' sibling module: shared rcParams)

    saved_argv, saved_rc = sys.argv, dict(plt.rcParams)
    sys.argv = [str(script), "--out", out]
    try:
        runpy.run_path(str(script), run_name="__main__")
        return True
    except SystemExit as e:
        return e.code in (None, 0)
    except Exception:  # noqa: BLE001  (report, go on with the next figure)
        traceback.print_exc()
        return False
    finally:
        sys.argv = saved_argv
        plt.close("all")
        plt.rcParams.update(saved_rc)


def run_all(out: str, only: list[str] | None = None, subprocesses: bool = False) -> list[str]:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    todo = scripts(only)
    failed, t_all = [], time.time()
    for i, script in enumerate(todo, 1):
        t0 = time.time()
        print(f"[figures] {i}/{len(todo)} {script.stem} ...", flush=True)
        if subprocesses:
            ok = subprocess.run([sys.executable, str(script), "--out", out]).returncode == 0
        else:
            ok = run_one(script, out)
        sys.stdout.flush()
        print(f"[figures] {i}/{len(todo)} {script.stem}: {'ok' if ok else 'FAILED'} ({time.time() - t0:.1f} s)",
              flush=True)
        if not ok:
            failed.append(script.name)
    print(f"[figures] {len(todo) - len(failed)}/{len(todo)} figures in {time.time() - t_all:.1f} s -> {out}",
          flush=True)
    return failed


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m paper_figures", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "out"), help="where the PNG and PDF files go")
    ap.add_argument("--only", nargs="*", help="figure name prefixes, e.g. fig01 fig09")
    ap.add_argument("--subprocess", action="store_true", help="run each figure script in its own process")
    a = ap.parse_args()
    if a.only is not None and not scripts(a.only):
        sys.exit(f"--only {' '.join(a.only)}: no figure script matches (have: "
                 f"{', '.join(s.stem for s in scripts())})")
    failed = run_all(a.out, a.only, a.subprocess)
    if failed:
        sys.exit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
