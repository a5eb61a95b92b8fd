# Sourced by the GPU check runners (run_all.sh, run_session.sh) after they set OUT_DIR and LOG:
# output tee'd to OUT_DIR/LOG, the repository root as working directory and on PYTHONPATH, and
# `step NAME TIMEOUT_S CMD...` to run a check bounded in time, logging its rc and seconds.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
HERE=experiments/gpu  # relative to ROOT: logs name no machine paths
mkdir -p "$OUT_DIR" && OUT_DIR=$(cd "$OUT_DIR" && pwd)
exec > >(tee -a "$OUT_DIR/$LOG") 2>&1
cd "$ROOT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}

step() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    local shown="$*"
    echo "=== $name (limit ${limit}s): ${shown//$OUT_DIR/OUT_DIR}"
    timeout -k 10 "$limit" "$@"
    local rc=$?
    echo "=== $name: rc=$rc in $((SECONDS - t0))s"
}
