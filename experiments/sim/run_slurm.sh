#!/usr/bin/env bash
# Submit one simulator sweep to Slurm (Hydra submitit launcher: one CPU job per sweep point),
# wait for it, and collect its CSVs into experiments/results/sim/<sweep>/.
#   experiments/sim/run_slurm.sh scale hydra.launcher.partition=cpu [seeds=50 ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
sweep=${1:?usage: run_slurm.sh <scale|mtbf|spares> [overrides]}; shift
PY=${PY:-.venv/bin/python}
dir=multirun/sim/$sweep/$(date +%Y-%m-%d_%H-%M-%S)
"$PY" -m sim.run experiment="sim_$sweep" hydra/launcher=sim_slurm hydra.sweep.dir="$dir" "$@"
"$PY" -m sim.collect "$dir" --out "experiments/results/sim/$sweep"
