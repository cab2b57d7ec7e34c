#!/usr/bin/env bash
# Everything the GPU machine runs for a release, in one go; results land in $OUT (default: bench-out).
#   bash tools/device_run.sh tests            # pytest -m gpu, log in $OUT/gpu_tests.log
#   bash tools/device_run.sh bench NAME...    # python3 -m gfxgraph.suites.NAME --out $OUT, one after another
#                                             # ($BENCH_ARGS, e.g. --quick, go to every suite)
# The package is installed in editable mode without dependencies (the machine is offline), so the
# torch.compile backend is found through its entry point exactly as for a user.
set -u -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$OUT/install.log" 2>&1 \
  || { echo "editable install failed (see install.log); using PYTHONPATH"; export PYTHONPATH=$PWD/src; }
export PYTHONPATH=${PYTHONPATH:-}:$PWD
what=${1:-tests}; shift || true
case "$what" in
  tests)
    python3 -m pytest -m gpu -q -p no:cacheprovider tests "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40 ;;
  bench)
    for name in "$@"; do
      # shellcheck disable=SC2086 # BENCH_ARGS is a list of options
      echo "== $name"; python3 -m "gfxgraph.suites.$name" --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/$name.log" | tail -40
    done ;;
  *) echo "usage: $0 tests|bench NAME..." >&2; exit 2 ;;
esac
