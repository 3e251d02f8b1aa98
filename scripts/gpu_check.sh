#!/usr/bin/env bash
# The checks that need a CUDA device, as one script for a GPU machine with no network
# (`make gpu-check`). It installs kvstore (no dependencies fetched) and the wheels in
# .whl/ that the machine lacks (`make gpu-wheels` downloads them, for Python 3.12) into
# a scratch site directory, then runs the tests marked `gpu` (the vLLM connector's CUDA
# copy engine over every cache layout, pinned slab, per-layer events), the copy engine
# bench (GB/s against raw cudaMemcpyAsync, overlap with a simulated forward pass) and the
# transport bench (with UCX, from the carried ucxx wheels, on the machine's many cores),
# whose overlap figure launches the layers' compute on the GPU, and the remote load between
# two daemons against a raw socket (bench.daemon --remote-fetch-only: on two cores the
# peer, this daemon and the engine share them; here each has its own). Figures and logs go to
# $OUT when it is set (the device tool's output folder), else to bench/out/gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-bench/out/gpu-check}
SITE=${SITE:-/tmp/kvstore-gpu-site}
mkdir -p "$OUT" "$SITE"
WHEELS=${WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHEELS"/*.whl || exit 1
fi
"$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" . || exit 1
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PYTHON" -c "import torch; print('cuda:', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')" | tee "$OUT/device.txt"
status=0
"$PYTHON" -m pytest -q -p no:cacheprovider -m gpu tests/ 2>&1 | tee "$OUT/gpu-tests.log" || status=1
"$PYTHON" -m bench.gpu_copies --quick --json 2>&1 | tee "$OUT/gpu_copies.log" || status=1
"$PYTHON" -c "import ucxx" 2>/dev/null || echo "ucxx does not import: the transport bench runs TCP only (make gpu-wheels fetches ucxx)" | tee "$OUT/ucx.txt"
"$PYTHON" -m bench.transport --quick --json 2>&1 | tee "$OUT/transport.log" || status=1
"$PYTHON" -m bench.daemon --remote-fetch-only --quick --json 2>&1 | tee "$OUT/remote_fetch.log" || status=1
exit $status
