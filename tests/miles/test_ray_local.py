"""The local Ray of a run (ensure_ray without an address): a new one even where another cluster is recorded on the
machine or named by RAY_ADDRESS, listening on loopback only, and gone within seconds of its driver's SIGKILL.

Each Ray here runs in a process of its own (the test session shares one Ray in this process), with its own Ray
temporary directory, so that neither the clusters of other processes on the machine nor this one's leftovers meet."""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from tests.helpers.waiting import eventually

ROOT = Path(__file__).resolve().parents[2]

# A run's driver: its local Ray with one actor alive; prints the GCS address, then stays up with `--stay`.
DRIVER = """
import json, os, sys, time
import ray
from miles.cluster.actors import ensure_ray

ensure_ray(None, actors=2)


@ray.remote(num_cpus=1)
class Probe:
    def pid(self):
        return os.getpid()


probe = Probe.remote()
print(json.dumps({"gcs": ray.get_runtime_context().gcs_address, "actor": ray.get(probe.pid.remote())}), flush=True)
if "--stay" in sys.argv:
    time.sleep(600)
"""


@pytest.fixture
def ray_env() -> Iterator[dict[str, str]]:
    """An environment whose Ray temporary directory (clusters recorded there included) is this test's alone: short,
    for Ray's socket paths."""
    root = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    env = {name: value for name, value in os.environ.items() if name != "RAY_ADDRESS"}
    env["RAY_TMPDIR"] = root
    yield env
    shutil.rmtree(root, ignore_errors=True)


def driver_report(driver: subprocess.Popen) -> dict:
    line = driver.stdout.readline()
    assert line, f"the driver failed:\n{driver.stderr.read()}"
    return json.loads(line)


@contextmanager
def staying_driver(env: dict[str, str]) -> Iterator[tuple[subprocess.Popen, dict, list[psutil.Process]]]:
    """A driver that stays up: (its process, its report, every process under it once its actor answered)."""
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER, "--stay"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    descendants: list[psutil.Process] = []
    try:
        report = driver_report(driver)
        descendants = psutil.Process(driver.pid).children(recursive=True)
        yield driver, report, descendants
    finally:
        driver.kill()
        driver.wait()
        kill(descendants)
        driver.stdout.close()
        driver.stderr.close()


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    def lives(process: psutil.Process) -> bool:
        try:
            return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    return [process for process in processes if lives(process)]


def kill(processes: list[psutil.Process]) -> None:
    for process in alive(processes):
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def is_loopback(host: str) -> bool:
    address = ipaddress.ip_address(host)
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def stray_cluster(env: dict[str, str]) -> Iterator[str]:
    """A cluster another process started with `ray start` and left recorded in the Ray temporary directory; its
    address. Its processes are found by their session (it starts one), not by `ray stop`, which stops every
    cluster on the machine."""
    ray = Path(sys.executable).with_name("ray")
    head = subprocess.Popen(
        [ray, "start", "--head", f"--port={free_port()}", "--num-cpus=1", "--include-dashboard=false", "--block"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        recorded = Path(env["RAY_TMPDIR"]) / "ray" / "ray_current_cluster"
        assert eventually(lambda: recorded.exists() and recorded.read_text().strip(), timeout_s=40, every_s=0.2)
        yield recorded.read_text().strip()
    finally:
        kill([process for process in psutil.process_iter() if session_of(process.pid) == head.pid])
        head.wait()


def session_of(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def test_a_local_run_starts_its_own_ray_beside_a_recorded_cluster(ray_env):
    env = {**ray_env, "RAY_AUTH_MODE": "disabled"}
    with stray_cluster(env) as stray:
        for driver_env in (env, {**env, "RAY_ADDRESS": stray}):
            driver = subprocess.run(
                [sys.executable, "-c", DRIVER], cwd=ROOT, env=driver_env, capture_output=True, text=True, timeout=120
            )
            assert driver.returncode == 0, driver.stderr
            assert json.loads(driver.stdout)["gcs"] != stray


def test_a_local_ray_listens_on_loopback_only(ray_env):
    with staying_driver(ray_env) as (driver, report, descendants):
        pids = {driver.pid} | {process.pid for process in descendants}
        listeners = eventually(
            lambda: [
                connection.laddr
                for connection in psutil.net_connections(kind="tcp")
                if connection.pid in pids and connection.status == psutil.CONN_LISTEN
            ]
        )
        exposed = [f"{address.ip}:{address.port}" for address in listeners if not is_loopback(address.ip)]
        assert listeners and not exposed
        assert is_loopback(report["gcs"].rpartition(":")[0].strip("[]"))


def test_nothing_of_a_local_ray_outlives_its_driver_killed(ray_env):
    with staying_driver(ray_env) as (driver, report, descendants):
        assert report["actor"] in {process.pid for process in descendants}
        names = {process.pid: process.name() for process in descendants}
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        eventually(lambda: not alive(descendants), timeout_s=15, every_s=0.2)
        assert not alive(descendants), [names[process.pid] for process in alive(descendants)]
