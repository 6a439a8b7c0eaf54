#!/usr/bin/env bash
# On a machine with a CUDA GPU: the engine and trainers on CUDA (scripts/gpu_check.py: correctness, a model of a
# pretrained model's size in bf16, throughput), in one process, with no Ray and no Prefect, and the peak memory of a
# colocated engine that releases its memory for the train step vs one that keeps it; the wheels it needs
# beyond the machine's own packages come from .whl/ (`make gpu-wheels`), installed with no package index. Then, where
# Ray and Prefect are installed, the sync flow for a few iterations with the TorchEngine and trainer on the GPU (the
# trainer unsharded in float32, then FSDP2 in bfloat16, with the trainer-vs-engine log-prob gap, then with weights
# broadcast over NCCL where there are two GPUs), and with SGLang serving the rollouts, its weights mapped through
# CUDA IPC, where SGLANG_PYTHON (default .venv-sglang/bin/python, `make install-gpu`) has it.
# `--dry-run` runs gpu_check.py on the CPU at small sizes and stops there. Under 10 minutes on one H200.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  site=$(mktemp -d)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" scripts/gpu_check.py "$@"
# A colocated torch engine and trainer on one GPU: the peak of CUDA's allocator with the engine releasing its memory
# for each train step vs keeping it (release_memory / resume_memory).
if [[ " $* " == *" --dry-run "* ]]; then
  "$PY" -m benchmarks.colocated_memory --smoke
else
  "$PY" -m benchmarks.colocated_memory --device cuda
fi
if [[ " $* " == *" --dry-run "* ]] || ! "$PY" -c "import ray, prefect" 2>/dev/null; then
  echo "the flow runs are skipped (a dry run, or no Ray or Prefect here)"
  exit 0
fi
flow_run() {  # flow_run <engine> [--set ...]: 10 rollouts of 512 samples, then generation and training throughput
  local engine=$1 run_dir started
  shift
  run_dir=$(mktemp -d)/run
  started=$(date +%s)
  "$PY" -m flows.cli run sync --run-dir "$run_dir" --num-rollout 10 --set rollout.engine="$engine" \
    --set rollout.device=cuda --set train.device=cuda --set model.warmup.max_steps=200 "$@"
  "$PY" -c "import json, sys; print(json.load(open(sys.argv[1]))['starts'][-1]['placement'])" "$run_dir/run.json"
  echo "sync flow with the $engine engine, 10 rollouts on CUDA: $(( $(date +%s) - started )) s wall (start-up included)"
  "$PY" - "$run_dir/metrics.jsonl" "$engine" <<'EOF'
import json, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "eval" not in r][1:]  # the first pays the warm-up
tokens = sum(r["samples"] * r["response_length_mean"] for r in rows)
print(f"{sys.argv[2]} engine in the flow: {tokens / sum(r['time_generate'] for r in rows):,.0f} generated tokens/s, "
      f"train step {sum(r['time_train'] for r in rows) / len(rows):.3f} s, weight sync {sum(r['time_sync'] for r in rows) / len(rows):.3f} s, "
      f"trainer vs engine log-prob gap {sum(r['train_rollout_logprob_abs_diff'] for r in rows) / len(rows):.4f}")
EOF
}

# On one GPU the engine shares it with the trainer (colocated); with two, each has its own and the weights go over
# NCCL (the placement's transport).
flow_run torch --set rollout.colocate=true
# The trainer as one FSDP2 worker computing in bfloat16 (NCCL process group of one), the engine in float32.
flow_run torch --set rollout.colocate=true --set train.sharding=fsdp --set train.param_dtype=bfloat16
if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  flow_run torch
fi
SGLANG_PYTHON=${SGLANG_PYTHON:-$PWD/.venv-sglang/bin/python}
if [ -x "$SGLANG_PYTHON" ] && "$SGLANG_PYTHON" -c "import sglang" 2>/dev/null; then
  # The trainer shares the GPU: SGLang takes what the trainer leaves, releases it for each train step, and maps the
  # trainer's weights (the tensor transport, CUDA IPC: the default for this placement).
  flow_run sglang --set rollout.sglang.python="$SGLANG_PYTHON" --set rollout.colocate=true
else
  echo "no SGLang at $SGLANG_PYTHON (make install-gpu): the SGLang flow run is skipped"
fi
