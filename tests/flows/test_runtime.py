"""The CLI's ephemeral API server runs in a session of its own, so that a Ctrl-C to the terminal's process group
does not stop it before the flow has recorded how it ended, and it dies with the process that started it. At idle it
leaves the CPU to the engines and the trainer (no service polls without sleeping), and when they compute it yields to
them."""

import os
import signal
import subprocess
import sys

import httpx
import pytest

from flows.runtime import SERVER_NICENESS
from tests.helpers.waiting import eventually

SCRIPT = """
import os, sys
from flows.runtime import configure_prefect, start_ephemeral_api
configure_prefect()
start_ephemeral_api()
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings
server = SubprocessASGIServer()
heartbeat = get_current_settings().flows.heartbeat_frequency
pid = server.server_process.pid
print(pid, os.getpgid(pid), os.getpgid(0), heartbeat, server.api_url, flush=True)
sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_ephemeral_api_server_idles_leaves_the_process_group_and_dies_with_its_parent(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    parent = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        *pids, heartbeat, api_url = parent.stdout.readline().split()
        server_pid, server_group, parent_group = map(int, pids)
        assert server_group != parent_group  # a signal to the parent's group does not reach the server
        assert heartbeat == "None"  # no heartbeat thread for a flow run's end to wait on
        assert os.getpriority(os.PRIO_PROCESS, server_pid) == SERVER_NICENESS  # below the engine and trainer
        # The task-run recorder sleeps its flush interval as whole seconds (`int()`) between flushes: under 1 s it polls
        # with no sleep and burns a whole core, taken from the engine and the trainer. As the server itself reads it:
        services = httpx.get(f"{api_url}/admin/settings", trust_env=False).json()["server"]["services"]
        assert int(services["task_run_recorder"]["flush_interval"]) >= 1
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        assert eventually(lambda: not _alive(server_pid), timeout_s=15, every_s=0.2)
    finally:
        parent.kill()


def test_a_deployment_can_restrict_paths_to_roots_and_ray_to_its_clusters(tmp_path):
    from control.policy import PlaceNotAllowed, check_allowed_places
    from miles.config import load_config

    root = tmp_path / "runs"
    (root / "data").mkdir(parents=True)
    (root / "escape").symlink_to("/etc")
    inside = load_config(None, [f"model.path={root / 'model'}"], run_dir=str(root / "a"))
    check_allowed_places(inside, [str(root)], ["10.0.0.1:6379"], "deployment rl-sync/tiny")
    check_allowed_places(inside.model_copy(update={"run_dir": "/anywhere"}), [], [], "anywhere")  # nothing restricted
    outside = load_config(
        None,
        [f"model.path={root / 'escape' / 'model'}", "data.task=null", "data.path=/etc/passwd", "ray_address=evil:1"],
        run_dir=str(root / ".." / "b"),
    )
    with pytest.raises(PlaceNotAllowed) as info:
        check_allowed_places(outside, [str(root)], ["10.0.0.1:6379"], "deployment rl-sync/tiny")
    assert str(info.value).splitlines() == [
        "deployment rl-sync/tiny: these settings name places the deployment does not allow:",
        f"  run_dir: {root / '..' / 'b'} is outside the allowed roots {root}",
        f"  model.path: {root / 'escape' / 'model'} is outside the allowed roots {root}",
        f"  data.path: /etc/passwd is outside the allowed roots {root}",
        "  ray_address: evil:1 is not one of 10.0.0.1:6379",
    ]
    # the models behind a reward are places too
    judged = load_config(None, ["data.reward=judge", "judge.model_path=/opt/judge"], run_dir=str(root / "c"))
    with pytest.raises(PlaceNotAllowed, match="judge.model_path: /opt/judge is outside the allowed roots"):
        check_allowed_places(judged, [str(root)], [], "deployment rl-sync/tiny")
