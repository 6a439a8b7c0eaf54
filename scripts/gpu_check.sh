#!/usr/bin/env bash
# On a machine with a CUDA GPU: the engine and trainers on CUDA (correctness and throughput), then, where Ray and
# Prefect are installed, the sync flow for a few iterations with engine and trainer on the GPU. Under 5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" scripts/gpu_check.py "$@"
if "$PY" -c "import ray, prefect" 2>/dev/null; then
  run_dir=$(mktemp -d)/run
  started=$(date +%s)
  "$PY" -m flows.cli run sync --run-dir "$run_dir" --num-rollout 10 \
    --set rollout.device=cuda --set train.device=cuda --set model.warmup.max_steps=200
  echo "sync flow, 10 rollouts of 512 samples on CUDA: $(( $(date +%s) - started )) s wall (warm-up and start-up included)"
else
  echo "ray or prefect not installed: the flow run is skipped"
fi
