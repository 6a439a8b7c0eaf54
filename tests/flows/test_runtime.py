"""The CLI's ephemeral API server runs in a session of its own, so that a Ctrl-C to the terminal's process group
does not stop it before the flow has recorded how it ended, and it dies with the process that started it. At idle it
leaves the CPU to the engines and the trainer, and when they compute it yields to them."""

import os
import signal
import subprocess
import sys
import time

from flows.runtime import SERVER_NICENESS

SCRIPT = """
import os, sys
from flows.runtime import configure_prefect, start_ephemeral_api
configure_prefect()
start_ephemeral_api()
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings
server = SubprocessASGIServer().server_process
heartbeat = get_current_settings().flows.heartbeat_frequency
print(server.pid, os.getpgid(server.pid), os.getpgid(0), heartbeat, flush=True)
sys.stdin.read()
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    user_ticks, system_ticks = int(fields[11]), int(fields[12])
    return (user_ticks + system_ticks) / os.sysconf("SC_CLK_TCK")


def test_the_ephemeral_api_server_idles_leaves_the_process_group_and_dies_with_its_parent(tmp_path):
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    parent = subprocess.Popen(
        [sys.executable, "-c", SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        *pids, heartbeat = parent.stdout.readline().split()
        server_pid, server_group, parent_group = map(int, pids)
        assert server_group != parent_group  # a signal to the parent's group does not reach the server
        assert heartbeat == "None"  # no heartbeat thread for a flow run's end to wait on
        assert os.getpriority(os.PRIO_PROCESS, server_pid) == SERVER_NICENESS  # below the engine and trainer
        # A service that polls in a loop with no sleep (the task-run recorder with a flush interval under 1 s) burns a
        # whole core here, taken from the engine and the trainer.
        time.sleep(2)  # let the services finish starting
        cpu_before = _cpu_seconds(server_pid)
        time.sleep(3)
        assert _cpu_seconds(server_pid) - cpu_before < 1.0
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 15
        while _alive(server_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(server_pid)
    finally:
        parent.kill()
