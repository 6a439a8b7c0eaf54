"""A PostgreSQL database for the Prefect server, kept in a directory of the project: Debian's PostgreSQL, bound to
127.0.0.1, with a password of its own.

    python -m deployments.postgres start [--dir .postgres] [--port 5433]   # prints the connection URL
    python -m deployments.postgres url   [--dir .postgres]
    python -m deployments.postgres stop  [--dir .postgres]

The first start creates the cluster (`initdb`) and the `prefect` database; later starts reuse them. The URL
(`postgresql+asyncpg://prefect:<password>@127.0.0.1:<port>/prefect`) is what PREFECT_API_DATABASE_CONNECTION_URL
takes; it is kept in `<dir>/connection_url`, readable by its owner only. PostgreSQL refuses to run as root, so
root runs it as Debian's `postgres` user.
"""

from __future__ import annotations

import argparse
import glob
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

DEFAULT_DIR = Path(".postgres")
DEFAULT_PORT = 5433  # beside a system cluster on 5432
SERVER_USER = "postgres"  # Debian's account for the server when root starts it


def installed() -> bool:
    return bool(glob.glob("/usr/lib/postgresql/*/bin/initdb") or shutil.which("initdb"))


def _binary(name: str) -> str:
    """`name` from the newest Debian PostgreSQL (its server binaries are not on PATH), else from PATH."""
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(Path(p).parts[-3]))
    path = found[-1] if found else shutil.which(name)
    if path is None:
        raise SystemExit(f"{name} not found: install PostgreSQL (Debian: apt-get install postgresql)")
    return path


def _as_server_user(args: list[str]) -> list[str]:
    return ["runuser", "-u", SERVER_USER, "--", *args] if os.geteuid() == 0 else args


def _run(args: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(_as_server_user(args), check=True, capture_output=True, text=True, **kwargs)


def connection_url(directory: Path) -> str:
    try:
        return (directory / "connection_url").read_text().strip()
    except FileNotFoundError:
        raise SystemExit(f"no database in {directory}: run `python -m deployments.postgres start` first") from None


def _create(directory: Path, port: int) -> None:
    data = directory / "data"
    password = secrets.token_urlsafe(24)
    directory.mkdir(parents=True, exist_ok=True)
    password_file = directory / "password"
    password_file.write_text(password)
    (directory / "socket").mkdir(exist_ok=True)
    if os.geteuid() == 0:
        shutil.chown(directory, SERVER_USER)
        for path in (password_file, directory / "socket"):
            shutil.chown(path, SERVER_USER)
    _run(
        [
            _binary("initdb"),
            "--pgdata",
            str(data),
            "--username",
            "prefect",
            "--pwfile",
            str(password_file),
            "--auth",
            "scram-sha-256",
            "--encoding",
            "UTF8",
        ]
    )
    password_file.unlink()
    url_file = directory / "connection_url"
    url_file.write_text(f"postgresql+asyncpg://prefect:{password}@127.0.0.1:{port}/prefect\n")
    url_file.chmod(0o600)


def start(directory: Path = DEFAULT_DIR, port: int = DEFAULT_PORT) -> str:
    """Start the server (creating it on first use) and return the connection URL."""
    directory = directory.resolve()
    data = directory / "data"
    fresh = not (data / "PG_VERSION").exists()
    if fresh:
        _create(directory, port)
    url = connection_url(directory)
    address = urlsplit(url)
    options = f"-c listen_addresses=127.0.0.1 -p {address.port} -c unix_socket_directories={directory / 'socket'}"
    running = subprocess.run(_as_server_user([_binary("pg_ctl"), "status", "-D", str(data)]), capture_output=True)
    if running.returncode != 0:
        _run([_binary("pg_ctl"), "start", "-D", str(data), "-l", str(data / "server.log"), "-o", options, "-w"])
    if fresh:
        _run(
            [_binary("createdb"), "-h", "127.0.0.1", "-p", str(address.port), "-U", "prefect", "prefect"],
            env={**os.environ, "PGPASSWORD": address.password},
        )
    return url


def stop(directory: Path = DEFAULT_DIR) -> None:
    data = directory.resolve() / "data"
    if (data / "postmaster.pid").exists():
        _run([_binary("pg_ctl"), "stop", "-D", str(data), "-m", "fast", "-w"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deployments.postgres", description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["start", "url", "stop"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where the cluster and its URL live")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port on 127.0.0.1 (first start only)")
    args = parser.parse_args(argv)
    try:
        if args.action == "start":
            print(start(args.dir, args.port))
        elif args.action == "url":
            print(connection_url(args.dir.resolve()))
        else:
            stop(args.dir)
    except subprocess.CalledProcessError as exc:
        print(f"error: {' '.join(exc.cmd)} failed:\n{exc.stderr}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
