#!/usr/bin/env bash
# The checkpointer's GPU path in one prepared run (for a lent GPU machine; CI has none):
# the CUDA tests, where a streamed snapshot's time goes (bench/gpu_snapshot.py), then bench/save.py on
# the GPU against torch.save and DCP async.
#   bash bench/gpu.sh [OUTDIR] [PARAMS_M]      (wheels for missing packages in .whl/, installed first)
set -o pipefail
out=${1:-${OUT:-/tmp/ucl-gpu}}; params=${2:-250}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c 'import sys, torch, h5py; print(sys.version.split()[0], "torch", torch.__version__, "h5py", h5py.__version__)'
  nproc; free -g | head -2; findmnt -T /tmp; df -h /tmp; } 2>&1 | tee "$out/env.txt"
timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -q -x -p no:cacheprovider tests/test_train_cuda.py 2>&1 \
  | tee "$out/tests.txt"
timeout "${SNAPSHOT_TIMEOUT:-90}" python3 bench/gpu_snapshot.py --repeat 3 2>&1 | tee "$out/snapshot.txt"
# BENCH_ARGS: e.g. "--every 10 --rounds 2 --variants torch.save dcp-async ucl ucl-flat --pools 0.25"; the default
# runs every 1 and 10 (about 310 s of a 257 M model on an H200; the whole script about 7.5 min): ucl is the default pool (a whole snapshot from
# a GPU where the host has room), ucl-pool0.25 the quarter pool a CPU model gets
timeout "${BENCH_TIMEOUT:-360}" python3 bench/save.py --device cuda --bf16-autocast --params-m "$params" --batch 8 \
  --seq 1024 ${BENCH_ARGS:---every 1 10 --rounds 2 --variants torch.save dcp-async ucl --pools 0.25} \
  --results "$out/results.jsonl" 2>&1 | tee "$out/bench.txt"
