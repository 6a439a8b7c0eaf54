"""What one task run costs Prefect, with no work in it: the flow process's CPU and the embedded API server's CPU per
task run, and the wall time, over flows of `--tasks` no-op task runs with the RL tasks' options (retries, no cache,
the history hook) and the RL flows' end (the history wait). Run it with a Prefect setting changed
(`PREFECT_SERVER_SERVICES_...=...`) to see what that setting costs; docs/benchmarks.md has the breakdown.

Last line: `task_run_server_ms <API server CPU ms per task run>`.
"""

from __future__ import annotations

import argparse
import os
import resource
import tempfile
import time

from benchmarks.smoke import parse_args
from flows.runtime import configure_prefect

os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="task-run-cost-"))
configure_prefect()

from prefect import flow, task  # noqa: E402
from prefect.server.api.server import SubprocessASGIServer  # noqa: E402

from flows.runtime import start_ephemeral_api  # noqa: E402
from tasks.history import wait_for_task_history  # noqa: E402
from tasks.options import task_options  # noqa: E402


@task(name="noop", task_run_name="noop[{i}]", **task_options(retries=1))
def noop(i: int) -> dict:
    return {"i": i}


@flow(name="task-run-cost")
def noops(n: int) -> None:
    for i in range(n):
        noop(i)


def _server_cpu_s() -> float:
    total = 0.0
    for server in SubprocessASGIServer._instances.values():
        fields = open(f"/proc/{server.server_process.pid}/stat").read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    return total


def _client_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=300, help="task runs per flow run")
    parser.add_argument("--repeats", type=int, default=2)
    args = parse_args(parser, tasks=3, repeats=1)
    start_ephemeral_api()
    noops(20)  # warm the client and the server
    server_ms = []
    for _ in range(args.repeats):
        server, client, started = _server_cpu_s(), _client_cpu_s(), time.perf_counter()
        wait_for_task_history([noops(args.tasks, return_state=True).state_details.flow_run_id])
        server_ms.append(1000 * (_server_cpu_s() - server) / args.tasks)
        wall = 1000 * (time.perf_counter() - started) / args.tasks
        client_ms = 1000 * (_client_cpu_s() - client) / args.tasks
        print(
            f"per task run: wall {wall:.1f} ms, flow process CPU {client_ms:.1f} ms, API server CPU {server_ms[-1]:.1f} ms"
        )
    print(f"task_run_server_ms {min(server_ms):.1f}")


if __name__ == "__main__":
    main()
