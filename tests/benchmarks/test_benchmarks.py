"""Every benchmark still runs: each script answers --help, and its --smoke run (the tiniest sizes, the same steps)
ends with its figure's line. A new script is picked up by its file name; nothing here checks a figure or a time."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments import postgres

PROJECT = Path(__file__).resolve().parents[2]
# Modules the scripts import; not run on their own.
HELPERS = ("prefect_server", "random_llama", "sglang_servers", "smoke")
SCRIPTS = sorted(path.stem for path in (PROJECT / "benchmarks").glob("*.py") if path.stem not in ("__init__", *HELPERS))
# The name on each script's last line, `<name> <value>`.
FIGURES = {
    "async_vs_sync": "speedup",
    "chaos": "chaos_kills",
    "colocated_memory": "colocated_memory_ratio",
    "engine_throughput": "engine_speedup",
    "episodes": "episode_batching_speedup",
    "events_lineage": "events_lineage_ratio",
    "fully_async_vs_sync": "fully_async_speedup",
    "gpu_tag": "gpu_tag_ratio",
    "handover": "handover_speedup",
    "judge_reward": "judge_agreement",
    "logprob_memory": "logprob_memory_ratio",
    "lora_base_memory": "lora_base_memory_ratio",
    "long_run": "long_run_growth",
    "multi_lora_memory": "memory_ratio",
    "orchestration_overhead": "overhead_ratio",
    "per_rank_push": "per_rank_push_time_ratio",
    "ppo_vs_grpo": "ppo_vs_grpo_greedy_gain",
    "reward_scoring": "reward_scoring_vs_pool",
    "sglang_client": "client_overhead",
    "sglang_transports": "fastest_push_vs_disk",
    "startup": "startup_seconds",
    "task_run_cost": "task_run_server_ms",
    "tenants": "tenants_wall_ratio",
    "token_budget": "token_budget_speedup",
    "train_step": "train_overhead",
    "trainer_groups": "trainer_groups_speedup",
    "trainer_scaling": "shard_memory_ratio",
    "weight_sync": "weight_sync_speedup",
}
# The smoke runs of a minute or more on 2 cores beside other tests (each starts a Prefect API and Ray workers, startup
# the CLI, chaos kills and restarts it): `make test-benchmarks` runs them, `make test` leaves them out (marker
# slow_smoke) to stay within its time.
SLOW = {
    "async_vs_sync",
    "chaos",
    "events_lineage",
    "fully_async_vs_sync",
    "gpu_tag",
    "long_run",
    "lora_base_memory",
    "orchestration_overhead",
    "per_rank_push",
    "sglang_transports",
    "startup",
    "tenants",
}


def _benchmark(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{script}", *args],
        cwd=PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_every_script_names_its_figure():
    assert sorted(FIGURES) == SCRIPTS


# Every script's --help in one fresh process: each script's own imports (torch, Prefect, Ray) are paid once.
HELP_ALL = """
import contextlib, io, json, runpy, sys
answers = {}
for script in sys.argv[1:]:
    sys.argv = [script, "--help"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_module(f"benchmarks.{script}", run_name="__main__")
            code = "returned without exiting"
        except SystemExit as exc:
            code = exc.code
    answers[script] = {"code": code, "stdout": out.getvalue()}
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def help_answers() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *SCRIPTS], cwd=PROJECT, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_help(script, help_answers):
    answer = help_answers[script]
    assert answer["code"] == 0 and "--smoke" in answer["stdout"], answer


@pytest.mark.parametrize(
    "script",
    [
        pytest.param(script, marks=[pytest.mark.slow, pytest.mark.slow_smoke]) if script in SLOW else script
        for script in SCRIPTS
    ],
)
def test_smoke(script, tmp_path, model_cache):
    if script == "gpu_tag" and not postgres.installed():
        pytest.skip("needs PostgreSQL (Debian's postgresql; .ci/run installs it)")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    # The session's model cache: the smoke runs' embedded model (no warm-up) is built once, in about a second.
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MILES_CACHE=str(model_cache))
    out = _benchmark(script, "--smoke", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    name, value = out.stdout.splitlines()[-1].split()
    assert name == FIGURES[script]
    float(value)  # raises unless the figure is a number
