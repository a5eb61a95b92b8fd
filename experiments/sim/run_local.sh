#!/usr/bin/env bash
# Run one simulator sweep locally (Hydra multirun, joblib launcher) and collect its CSVs
# into experiments/results/sim/<sweep>/ where paper_figures reads them.
#   experiments/sim/run_local.sh scale [extra Hydra overrides, e.g. seeds=5]
set -euo pipefail
cd "$(dirname "$0")/../.."
sweep=${1:?usage: run_local.sh <scale|mtbf|spares> [overrides]}; shift
PY=${PY:-.venv/bin/python}
dir=multirun/sim/$sweep/$(date +%Y-%m-%d_%H-%M-%S)
"$PY" -m sim.run experiment="sim_$sweep" hydra/launcher=sim_joblib hydra.sweep.dir="$dir" "$@"
"$PY" -m sim.collect "$dir" --out "experiments/results/sim/$sweep"
