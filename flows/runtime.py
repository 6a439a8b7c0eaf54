"""Where Prefect keeps its state for a run, and what every RL flow shares.

`configure_prefect` must run before the first `import prefect`: Prefect reads these settings at import.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# What the embedded API does per task run, set down to what a user reads (docs/benchmarks.md has the profile). By
# default the task-run recorder writes each task-run event in a transaction of its own: three per task run, ~25 ms of
# the server's CPU on SQLite. Batched, it writes the same rows in ~4 ms per task run, and the UI shows a state within
# a second. The recorder reads its flush interval as whole seconds (`int()`): below 1 it sleeps 0 s and spins a core.
# The event feed repeats those states (~5 ms per task run to store), and automations have nothing to act on in an API
# that lives as long as one run: neither runs here.
EMBEDDED_API_SETTINGS = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
}


def configure_prefect(project_dir: Path | None = None) -> None:
    """Project-local PREFECT_HOME (an explicit one wins), no telemetry, our library's logs in the UI, and the
    embedded API's settings (each one an explicit setting wins over)."""
    os.environ.setdefault("PREFECT_HOME", str((project_dir or Path.cwd()) / ".prefect"))
    for name, value in EMBEDDED_API_SETTINGS.items():
        os.environ.setdefault(name, value)
    # A new database's migrations can outlast Prefect's 20 s wait for the embedded API on a small, busy machine.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_LOGGING_EXTRA_LOGGERS", "miles")
    # The terminal gets warnings and our progress lines; the API (and so the UI) still gets every INFO log.
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


SERVER_NICENESS = 19


def start_ephemeral_api() -> None:
    """Start Prefect's ephemeral API server now, in a session of its own (unless PREFECT_API_URL names a server).

    Prefect would start it on first use in this process's group, where a Ctrl-C or a group kill (`timeout`, a job
    runner) stops it at once while this process still reports the crash through it: "Error logging to API", minutes
    of retries, and a flow run left Running in the UI. Prefect stops the server at exit, after the last logs; on
    Linux the kernel kills it at once when this process is killed outright, as a kill of its group would.

    Flow-run heartbeats go off: they feed automations that find crashed runs, which an API that dies with this
    process does not run, and a flow run's end waited up to a second for the heartbeat thread's sleep.
    """
    import ctypes
    import signal
    import subprocess

    from prefect.context import GLOBAL_SETTINGS_CONTEXT
    from prefect.server.api import server as api_server
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    # Loaded here: the child may only call into it. PR_SET_PDEATHSIG is Linux's alone.
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None

    def prepare_server() -> None:
        # Bookkeeping yields to the work: Ray starts the engine and trainer workers at nice 15, and a server at 0
        # took its CPU from them in the middle of their steps. The flow process, which waits on the server only at a
        # flow run's start and end, keeps its priority.
        os.setpriority(os.PRIO_PROCESS, 0, SERVER_NICENESS)
        if libc is not None:
            libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG; this (the main) thread lives as long as the process

    class NewSession:
        """`subprocess` as Prefect's server launch sees it: Popen starts a session of its own."""

        def __getattr__(self, name):
            return getattr(subprocess, name)

        @staticmethod
        def Popen(*args, **kwargs):
            return subprocess.Popen(*args, start_new_session=True, preexec_fn=prepare_server, **kwargs)

    class Server(api_server.SubprocessASGIServer):  # the singleton that get_client() then finds and reuses
        def _run_uvicorn_command(self):
            api_server.subprocess = NewSession()
            try:
                return super()._run_uvicorn_command()
            finally:
                api_server.subprocess = subprocess

    Server().start()
    GLOBAL_SETTINGS_CONTEXT.settings.flows.heartbeat_frequency = None  # no environment value means "none"


@contextmanager
def quiet_config_errors() -> Iterator[None]:
    """The terminal is spared the traceback of a ConfigError raised in a flow run (the CLI prints its message in one
    line); the flow run's log in the API keeps it."""
    import logging

    import prefect.main  # noqa: F401 - sets up Prefect's logging, whose console handlers are filtered here
    from prefect.logging.handlers import PrefectConsoleHandler

    from miles.config import ConfigError

    def not_a_config_error(record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], ConfigError))

    loggers = [logging.getLogger(), *map(logging.getLogger, list(logging.root.manager.loggerDict))]
    consoles = {
        h for logger in loggers for h in getattr(logger, "handlers", ()) if isinstance(h, PrefectConsoleHandler)
    }
    for handler in consoles:
        handler.addFilter(not_a_config_error)
    try:
        yield
    finally:
        for handler in consoles:
            handler.removeFilter(not_a_config_error)
