"""Deployments end to end: a Prefect server on 127.0.0.1 (on SQLite, and on PostgreSQL), the served deployments,
`prefect deployment run`."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

from miles.config import MID_RUN_FIELDS, load_config
from miles.state.run_dir import RunDir
from tests.helpers.waiting import eventually

PROJECT = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).with_name("prefect"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args, env, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        args, env=env, cwd=PROJECT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def _stop(proc: subprocess.Popen) -> None:
    # `prefect serve` and workers may ignore SIGTERM; the whole group goes.
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is None:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                continue


def _wait(predicate, timeout_s: float, what: str):
    """The first truthy value of `predicate()`; an HTTP error counts as none yet (the server is still starting)."""

    def answered():
        try:
            return predicate()
        except httpx.HTTPError:
            return None

    result = eventually(answered, timeout_s=timeout_s, every_s=0.5)
    assert result, f"timed out waiting for {what}"
    return result


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def database(request) -> dict[str, str]:
    """The Prefect server's database, as environment: its SQLite file under PREFECT_HOME, or PostgreSQL."""
    if request.param == "sqlite":
        yield {}
        return
    from deployments import postgres

    if not postgres.installed():
        pytest.skip("needs PostgreSQL (Debian's postgresql; .ci/run installs it)")
    # Not under pytest's tmp_path, which only root may enter: the server runs as the postgres user when root starts it.
    directory = Path(tempfile.mkdtemp(prefix="miles-postgres-"))
    try:
        # With PostgreSQL, generate carries the gpu tag (as `make server-postgres` sets it), under a concurrency limit.
        yield {"PREFECT_API_DATABASE_CONNECTION_URL": postgres.start(directory, _free_port()), "MILES_GPU_TAG": "gpu"}
    finally:
        postgres.stop(directory)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir, database):
    tmp_path = tmp_path_factory.mktemp("served")
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_SERVER_LOG_RETRYABLE_ERRORS="true",  # server.log says why the API answered 503
        DO_NOT_TRACK="1",
        PREFECT_UI_API_URL=api,
        PYTHONPATH=str(PROJECT),
        **database,
    )
    server = _start(
        [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, tmp_path / "server.log"
    )
    env.update(PREFECT_API_URL=api, PREFECT_RUNNER_POLL_FREQUENCY="1")
    config_file = tmp_path / "small.yaml"
    config_file.write_text(
        yaml.safe_dump(
            {
                "run_dir": str(tmp_path / "run"),
                "num_rollout": 4,
                "iterations_per_run": 2,
                "save_interval": 100,
                "model": {"path": str(tiny_model_dir)},
                "data": {"reward": "digit_match"},
                "rollout": {"rollout_batch_size": 8, "n_samples_per_prompt": 4, "num_threads": 1},
                "train": {"global_batch_size": 16, "micro_batch_size": 16, "num_threads": 1},
            }
        )
    )
    try:
        _wait(lambda: httpx.get(f"{api}/health").status_code == 200, 90, "the Prefect server")
        if "MILES_GPU_TAG" in database:
            limit = {"tag": database["MILES_GPU_TAG"], "concurrency_limit": 1}
            httpx.post(f"{api}/concurrency_limits/", json=limit).raise_for_status()
        serve = _start(
            [
                sys.executable,
                "-m",
                "deployments.serve",
                "--config",
                str(config_file),
                "--allow-module",
                ALLOWED_REWARDS.partition(":")[0],
                "--allow-root",
                str(tmp_path.parent),  # every test's directories
                "--allow-root",
                str(tiny_model_dir.parent),  # the session's model cache, which the test workers share
            ],
            env,
            tmp_path / "serve.log",
        )
        try:
            for name in ("rl-sync", "rl-multi-lora", "rl-tenant-submit", "rl-tenant-withdraw", "rl-eval", "rl-sweep"):
                _wait(
                    lambda: httpx.get(f"{api}/deployments/name/{name}/tiny").status_code == 200,  # noqa: B023
                    90,
                    f"the served deployment {name}/tiny",
                )
            yield api, env, config_file
        finally:
            _stop(serve)
    finally:
        _stop(server)


def _deployment_run(env, params: dict, expect_success: bool = True) -> str:
    return _run_deployment(env, "rl-sync/tiny", {"config": params}, expect_success=expect_success)


def _run_deployment(env, deployment: str, parameters: dict, expect_success: bool = True, watch: bool = True) -> str:
    """`prefect deployment run` as a user types it; the flow run's id. Without `watch` it returns once the run is
    created."""
    params = [part for name, value in parameters.items() for part in ("--param", f"{name}={json.dumps(value)}")]
    watching = ["--watch", "--watch-timeout", "300"] if watch else []
    out = subprocess.run(
        [PREFECT, "deployment", "run", deployment, *params, *watching],
        env=env,
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=330,
    )
    assert (out.returncode == 0) is expect_success, out.stdout[-2000:] + out.stderr[-2000:]
    return re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)


@pytest.fixture(scope="module")
def first_run(served) -> tuple[str, dict]:
    _, env, config_file = served
    params = load_config(config_file).model_dump(mode="json")
    return _deployment_run(env, params), params


def test_deployment_run_records_history_and_resumes(served, first_run):
    api, env, _ = served
    first, params = first_run
    flow_run = httpx.get(f"{api}/flow_runs/{first}").json()
    assert flow_run["state_type"] == "COMPLETED"
    # The slice's last push is left out: no closing evaluation reads it, and the next slice's engines start from the
    # checkpoint.
    expected = {f"{task}[rollout={i}]" for i in (0, 1) for task in ("generate", "get", "train_step")}
    expected.add("sync_weights[rollout=0]")

    def all_stored() -> list[dict] | None:  # the server stores task-run states after the flow run has ended
        task_runs = httpx.post(f"{api}/task_runs/filter", json={"flow_runs": {"id": {"any_": [first]}}}).json()
        completed = {t["name"] for t in task_runs if t["state_type"] == "COMPLETED"}
        return task_runs if expected <= completed else None

    task_runs = _wait(all_stored, 30, "the first run's task runs, completed")
    names = {t["name"] for t in task_runs}
    assert "generate[rollout=2]" not in names  # iterations_per_run=2: this run stops after rollout 1
    gpu_tags = [env["MILES_GPU_TAG"]] if "MILES_GPU_TAG" in env else []
    assert {tuple(t["tags"]) for t in task_runs if t["name"].startswith("generate")} == {tuple(gpu_tags)}
    artifacts = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [first]}}}).json()
    kinds = {a["type"] for a in artifacts}
    assert {"progress", "table", "markdown"} <= kinds
    summary = next(a for a in artifacts if a["key"] == "rl-sync-summary")["data"]
    assert "checkpoints/1" in summary and "reward_curve.png" in summary
    run_dir = Path(params["run_dir"])
    assert (run_dir / "reward_curve.png").stat().st_size > 1000

    second = _deployment_run(env, params)
    assert second != first
    assert [r["rollout_id"] for r in RunDir(run_dir).metrics()] == [0, 1, 2, 3]
    assert not (run_dir / "run.lock").exists()


ALLOWED_REWARDS = "tests.miles.rollout.rewards_for_tests:fails_on_some_labels"  # digit_match on these labels


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)  # the flow's check, whatever the database
def test_a_deployment_run_imports_only_what_the_deployment_allows(served, tmp_path):
    api, env, config_file = served
    params = load_config(config_file, ["num_rollout=1"], run_dir=str(tmp_path / "refused")).model_dump(mode="json")
    params["data"]["reward"] = "subprocess:getoutput"
    refused = httpx.get(f"{api}/flow_runs/{_deployment_run(env, params, expect_success=False)}").json()
    assert refused["state_type"] == "FAILED"
    assert (
        "deployment rl-sync/tiny: imports are allowed only from miles, tests.miles.rollout.rewards_for_tests:\n"
        "  data.reward: module 'subprocess' is not allowed"
    ) in refused["state"]["message"]
    assert not (tmp_path / "refused").exists()  # refused before the run directory, the actors or the engines

    params["data"]["reward"] = ALLOWED_REWARDS
    params["run_dir"] = "/var/tmp/elsewhere"
    refused = httpx.get(f"{api}/flow_runs/{_deployment_run(env, params, expect_success=False)}").json()
    assert refused["state_type"] == "FAILED"
    assert "  run_dir: /var/tmp/elsewhere is outside the allowed roots" in refused["state"]["message"]
    assert not Path("/var/tmp/elsewhere").exists()

    params.update(run_dir=str(tmp_path / "allowed"))
    params["data"]["reward"] = ALLOWED_REWARDS
    allowed = httpx.get(f"{api}/flow_runs/{_deployment_run(env, params)}").json()
    assert allowed["state_type"] == "COMPLETED"
    assert [r["rollout_id"] for r in RunDir(tmp_path / "allowed").metrics()] == [0]


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_a_deployment_run_starts_only_the_programs_the_deployment_starts(served, tmp_path):
    """The SGLang server's Python, module and flags start programs on the workers: a run may not change them."""
    api, env, config_file = served
    params = load_config(config_file, ["num_rollout=1"], run_dir=str(tmp_path / "refused")).model_dump(mode="json")
    params["rollout"]["sglang"].update(python="/bin/bash", extra_args=["-c", "id"])
    refused = httpx.get(f"{api}/flow_runs/{_deployment_run(env, params, expect_success=False)}").json()
    assert refused["state_type"] == "FAILED"
    message = refused["state"]["message"]
    assert "deployment rl-sync/tiny: these settings choose programs the workers start" in message
    assert "rollout.sglang.python: '/bin/bash' (the deployment's: None)" in message
    assert "rollout.sglang.extra_args: ['-c', 'id'] (the deployment's: [])" in message
    assert "server_module" not in message  # unchanged, so not named
    assert not (tmp_path / "refused").exists()  # refused before the run directory, the actors or the engines


# A budget it never reaches: it trains until it is withdrawn, after the tenant has retired. Its rollouts take about a
# second (eight optimizer steps), few task runs a second for the SQLite API to store beside the submissions.
SERVICE_ADAPTER = (
    "adapters=[{name: add, data: {task: addition, reward: digit_match}, num_steps: 100000, rollout_batch_size: 8,"
    " n_samples_per_prompt: 8, global_batch_size: 16, eval: {datasets: []}}]"
)


@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_a_tenant_submitted_through_its_deployment_trains_and_retires_while_another_trains(served):
    api, env, config_file = served
    run_dir = Path(f"{load_config(config_file).run_dir}-multi-lora")  # the tenant deployments' run directory
    overrides = [SERVICE_ADAPTER, "tenants.idle_timeout_s=1", "iterations_per_run=null", "save_interval=100000"]
    # The service trains the toy adapter several times a second: on SQLite, Prefect's own writes of its task runs
    # leave deployment runs created beside it few gaps (503, database is locked), so it sends no events of its own.
    overrides += ["train.num_passes=2", "logging.events=false"]
    config = load_config(config_file, overrides, run_dir=str(run_dir)).model_dump(mode="json")
    service = _run_deployment(env, "rl-multi-lora/tiny", {"config": config}, watch=False)
    try:
        _a_tenant_trains_and_retires_while_another_trains(api, env, run_dir, service)
    finally:  # a failure here leaves no service writing beside the next tests
        subprocess.run([PREFECT, "flow-run", "cancel", service], env=env, capture_output=True, timeout=60)


def _a_tenant_trains_and_retires_while_another_trains(api, env, run_dir: Path, service: str) -> None:
    _wait(lambda: RunDir(run_dir).adapter("add").ledger().trained, 240, "the configured adapter's first rollout")

    tenant = {"name": "late", "data": {"task": "addition", "reward": "digit_match"}, "num_steps": 2}
    tenant.update(rollout_batch_size=4, n_samples_per_prompt=4, eval={"datasets": []})
    submitted = _run_deployment(env, "rl-tenant-submit/tiny", {"adapter": tenant})
    assert httpx.get(f"{api}/flow_runs/{submitted}").json()["state_type"] == "COMPLETED"
    refused = dict(tenant, name="sneaky", data={"task": "addition", "reward": "subprocess:getoutput"})
    refusal = _run_deployment(env, "rl-tenant-submit/tiny", {"adapter": refused}, expect_success=False)
    message = httpx.get(f"{api}/flow_runs/{refusal}").json()["state"]["message"]
    assert "deployment rl-tenant-submit/tiny: imports are allowed only from miles" in message
    assert "module 'subprocess' is not allowed" in message
    outside = dict(tenant, name="outside", data={"task": None, "path": "/var/tmp/elsewhere/prompts.jsonl"})
    refusal = _run_deployment(env, "rl-tenant-submit/tiny", {"adapter": outside}, expect_success=False)
    refused_run = httpx.get(f"{api}/flow_runs/{refusal}").json()
    message = refused_run["state"]["message"]
    assert refused_run["state_type"] == "FAILED"
    assert "deployment rl-tenant-submit/tiny: these settings name places the deployment does not allow" in message
    assert "adapters.1.data.path: /var/tmp/elsewhere/prompts.jsonl is outside the allowed roots" in message
    assert sorted(p.name for p in (run_dir / "tenants").iterdir()) == ["late.json"]
    _wait(lambda: sorted(RunDir(run_dir).adapter("late").ledger().trained) == [0, 1], 240, "the tenant's 2 rollouts")

    withdrawn = _run_deployment(env, "rl-tenant-withdraw/tiny", {"name": "add", "reason": "enough"})
    assert httpx.get(f"{api}/flow_runs/{withdrawn}").json()["state_type"] == "COMPLETED"
    ended = _wait(
        lambda: (
            (run := httpx.get(f"{api}/flow_runs/{service}").json())["state_type"] in ("COMPLETED", "FAILED") and run
        ),
        300,
        "the multi-LoRA flow run's end",
    )
    assert ended["state_type"] == "COMPLETED", ended["state"]["message"]
    last = max(RunDir(run_dir).adapter("add").ledger().trained)
    assert sorted(RunDir(run_dir).adapter("add").ledger().trained) == list(range(last + 1))
    assert (run_dir / "adapters" / "add" / "checkpoints" / str(last)).is_dir()  # saved as it was withdrawn

    wanted = ["retire_adapter[late]", f"train_step[add, rollout={last}]", "retire_adapter[add]"]

    def stored() -> dict[str, dict] | None:  # the server stores task-run states after the flow run has ended
        query = {"flow_runs": {"id": {"any_": [service]}}, "task_runs": {"name": {"any_": wanted}}}
        runs = httpx.post(f"{api}/task_runs/filter", json=query).json()
        by_name = {t["name"]: t for t in runs if t["state_type"] == "COMPLETED"}
        return by_name if by_name.keys() == set(wanted) else None

    task_runs = _wait(stored, 30, "the service's task runs, completed")
    # The tenant trained and retired while the configured adapter was still training.
    assert task_runs["retire_adapter[late]"]["end_time"] < task_runs[f"train_step[add, rollout={last}]"]["start_time"]


CHROMIUM = Path("/usr/bin/chromium")


def _chromium(p):
    return p.chromium.launch(
        executable_path=str(CHROMIUM),
        args=[
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
        ],
    )


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (.ci/run installs it)")
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_the_ui_shows_the_flow_run_its_task_runs_and_the_reward_curve(served, first_run, tmp_path):
    from playwright.sync_api import sync_playwright

    api, _, _ = served
    flow_run_id, _ = first_run
    ui = api.removesuffix("/api")
    artifacts = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})
    summary_id = next(a["id"] for a in artifacts.json() if a["key"] == "rl-sync-summary")
    with sync_playwright() as p:
        browser = _chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{ui}/runs/flow-run/{flow_run_id}")
            page.get_by_text("rl-sync").first.wait_for(timeout=60_000)
            page.get_by_text("Task Runs", exact=True).click()
            for name in ("generate[rollout=0]", "get[rollout=0]", "train_step[rollout=0]", "sync_weights[rollout=0]"):
                page.get_by_text(name, exact=True).first.wait_for(timeout=60_000)
            page.screenshot(path=str(tmp_path / "flow-run.png"), full_page=True)

            # The run summary draws the reward curve itself: an image the browser decoded, not a file path.
            page.goto(f"{ui}/artifacts/artifact/{summary_id}")
            curve = page.locator("img[src^='data:image/png;base64,']").first
            curve.wait_for(timeout=60_000)
            width = curve.evaluate("img => img.complete ? img.naturalWidth : 0")
            page.screenshot(path=str(tmp_path / "summary.png"), full_page=True)
        finally:
            browser.close()
    assert (tmp_path / "flow-run.png").stat().st_size > 10_000
    assert width == 700  # the PNG's own width (7 in at 100 dpi): the image loaded


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (.ci/run installs it)")
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_a_paused_run_takes_the_form_in_the_ui_at_resume_and_its_checkpoints_start_rl_eval(served, tmp_path):
    from playwright.sync_api import sync_playwright

    api, env, config_file = served
    ui = api.removesuffix("/api")
    run_dir = tmp_path / "steered"
    overrides = ["eval.datasets=[{name: sums, task: addition, max_prompts: 8}]", "iterations_per_run=null"]
    params = load_config(config_file, overrides, run_dir=str(run_dir), num_rollout=6, save_interval=3)
    flow_run_id = _run_deployment(env, "rl-sync/tiny", {"config": params.model_dump(mode="json")}, watch=False)
    _wait(lambda: httpx.get(f"{api}/flow_runs/{flow_run_id}").json()["state_type"] == "RUNNING", 120, "the run")

    # `miles pause` as a user types it; the run pauses at the boundary after its first iteration, with the form.
    pause = [sys.executable, "-m", "flows.cli", "pause", flow_run_id, "--reason", "check the samples"]
    subprocess.run(pause, env=env, cwd=PROJECT, check=True, capture_output=True, timeout=60)

    def paused_at_a_boundary():
        state = httpx.get(f"{api}/flow_runs/{flow_run_id}").json()["state"]
        return state["type"] == "PAUSED" and state["state_details"]["pause_key"] and state

    _wait(paused_at_a_boundary, 120, "the run's own pause, at a boundary")

    def resumed() -> bool:
        return httpx.get(f"{api}/flow_runs/{flow_run_id}").json()["state_type"] != "PAUSED"

    with sync_playwright() as p:
        browser = _chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            # A user submits again when the UI reports that the server was busy: on SQLite, Prefect answers a write
            # that meets another one with an error (database is locked) rather than waiting for it.
            submissions = 0
            while submissions < 3 and not resumed():
                page.goto(f"{ui}/runs/flow-run/{flow_run_id}")
                page.get_by_role("button", name="Resume").first.click(timeout=60_000)
                page.get_by_text("Paused before rollout 1").first.wait_for(timeout=60_000)  # the form's description
                form = page.get_by_role("dialog")
                labels = [form.get_by_text(f"{name} (Optional)", exact=True).count() for name in ("Lr", "Temperature")]
                lr = form.locator("input").nth(list(MID_RUN_FIELDS).index("lr"))  # one input per field, in order
                prefilled = lr.input_value()
                lr.fill("0.003")
                texts = form.locator("input[type=text], textarea")
                texts.first.fill("ui")  # changed_by (reason is the other text field)
                page.screenshot(path=str(tmp_path / "pause-form.png"), full_page=True)
                form.get_by_role("button", name="Submit").click()
                submissions += 1
                eventually(resumed, timeout_s=30, every_s=0.5)
            assert resumed(), f"the run did not resume from the UI's form ({submissions} submissions; see server.log)"
        finally:
            browser.close()
    assert labels == [1, 1] and float(prefilled) == params.train.lr
    ended = _wait(
        lambda: (
            (run := httpx.get(f"{api}/flow_runs/{flow_run_id}").json())["state_type"] in ("COMPLETED", "FAILED") and run
        ),
        300,
        "the run's end",
    )
    assert ended["state_type"] == "COMPLETED", ended["state"]["message"]
    (change,) = RunDir(run_dir).recorded_changes()
    assert (change["rollout_id"], change["values"], change["by"]) == (1, {"train.lr": 0.003}, "ui")
    assert [m["lr"] for m in RunDir(run_dir).metrics()] == [params.train.lr] + [0.003] * 5

    # Each checkpoint (saved at the pause, and every 3 rollouts) started an rl-eval flow run of its own.
    checkpoints = [str(RunDir(run_dir).checkpoint(i)) for i in (0, 2, 5)]

    def evaluated():
        query = {"flows": {"name": {"any_": ["rl-eval"]}}, "flow_runs": {"state": {"type": {"any_": ["COMPLETED"]}}}}
        runs = httpx.post(f"{api}/flow_runs/filter", json=query).json()
        done = sorted(
            r["parameters"]["checkpoint"] for r in runs if r["parameters"]["checkpoint"].startswith(str(run_dir))
        )
        return done == checkpoints and runs

    _wait(evaluated, 300, "an rl-eval flow run per checkpoint, completed")
    for i in (0, 2, 5):
        (record,) = json.loads((run_dir / "evaluations" / f"checkpoint-{i}.json").read_text())
        assert record["weight_version"] == i + 1 and record["eval"] == "sums"

    # The UI shows the iteration events in the event feed and the lineage of a checkpoint as an artifact.
    lineage = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"key": {"any_": ["steered-lineage"]}}}).json()
    with sync_playwright() as p:
        browser = _chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{ui}/events")
            iteration_event = page.get_by_text("miles.iteration.finished").first
            iteration_event.wait_for(timeout=60_000)
            iteration_event.scroll_into_view_if_needed()
            page.screenshot(path=str(tmp_path / "event-feed.png"))
            page.goto(f"{ui}/artifacts/artifact/{lineage[0]['id']}")
            page.get_by_text("lineage of checkpoint").first.wait_for(timeout=60_000)
            page.screenshot(path=str(tmp_path / "lineage.png"), full_page=True)
        finally:
            browser.close()
    assert len(lineage) == 3
    assert (tmp_path / "event-feed.png").stat().st_size > 10_000 and (tmp_path / "lineage.png").stat().st_size > 10_000


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium (.ci/run installs it)")
@pytest.mark.parametrize("database", ["sqlite"], indirect=True)
def test_a_sweep_runs_its_variants_as_runs_of_a_deployment_and_the_ui_shows_the_comparison(served, tmp_path):
    from playwright.sync_api import sync_playwright

    api, env, config_file = served
    base = load_config(config_file, ["iterations_per_run=null"], run_dir=str(tmp_path / "sweep"), num_rollout=2)
    parameters = {
        "config": base.model_dump(mode="json"),
        "grid": {"train.lr": [0.001, 0.002]},
        "deployment": "rl-sync/tiny",
    }
    sweep_id = _run_deployment(env, "rl-sweep/tiny", parameters)
    children = httpx.post(
        f"{api}/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [sweep_id]}}}
    ).json()
    sync_deployment = httpx.get(f"{api}/deployments/name/rl-sync/tiny").json()["id"]
    assert sorted(c["parameters"]["config"]["train"]["lr"] for c in children) == [0.001, 0.002]
    assert {c["deployment_id"] for c in children} == {sync_deployment}
    assert {c["state_type"] for c in children} == {"COMPLETED"}
    artifacts = httpx.post(f"{api}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [sweep_id]}}}).json()
    (comparison,) = [a for a in artifacts if a["key"] == "rl-sweep-comparison"]
    assert "| train.lr=0.001 | 2 |" in comparison["data"] and "| train.lr=0.002 | 2 |" in comparison["data"]
    with sync_playwright() as p:
        browser = _chromium(p)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{api.removesuffix('/api')}/artifacts/artifact/{comparison['id']}")
            curves = page.locator("img[src^='data:image/png;base64,']").first
            curves.wait_for(timeout=60_000)
            width = curves.evaluate("img => img.complete ? img.naturalWidth : 0")
            page.screenshot(path=str(tmp_path / "sweep.png"), full_page=True)
        finally:
            browser.close()
    assert width == 800  # the PNG's own width (8 in at 100 dpi): the image loaded
