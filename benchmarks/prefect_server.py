"""A Prefect server on 127.0.0.1 for the benchmarks that need one outside the flow process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def prefect_server(env: dict[str, str], log: Path) -> Iterator[str]:
    """`prefect server start` with `env` on a free port; yields its API URL once healthy, kills it at the end."""
    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env={**env, "PREFECT_UI_API_URL": api},  # the UI's pages call this API, not the default port 4200
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{api}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"the Prefect server did not start: {log}")
            time.sleep(0.5)
        yield api
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
