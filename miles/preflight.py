"""Checks of a run's start that need no engine, trainer or workflow server: the run directory (a directory we may
write, not trained by another process now, its config unchanged in what a rollout or a step means), the machine
(the devices asked for, the Ray cluster named), and the starting model's files (`load_model_files`). Each failure is a ConfigError naming the
field or the file, raised in seconds, before Prefect and Ray start (the `miles` CLI) and again at a run's start."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from miles.config import ConfigError, RunConfig, config_changes
from miles.state.run_dir import RunDir

RAY_CONNECT_TIMEOUT_S = 5.0


def check_start(config: RunConfig) -> None:
    check_run_dir(config)
    check_devices(config)
    check_ray_address(config.ray_address)


def check_run_dir(config: RunConfig) -> None:
    run_dir = RunDir(config.run_dir)
    path = run_dir.path
    if path.exists() and not path.is_dir():
        raise ConfigError(f"run_dir: {path} is a file, not a directory")
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir: {path} cannot be written ({existing} is not writable)")
    if not path.is_dir():
        return
    if run_dir.lock_path.exists():
        try:
            run_dir.lock().release()
        except RuntimeError as exc:
            raise ConfigError(f"run_dir: {exc}") from None
    check_config_unchanged(run_dir, config)


def check_config_unchanged(run_dir: RunDir, config: RunConfig) -> None:
    """A run that has done work resumes only with the config it did it with, in every field that changes what a
    rollout or a step means (docs/getting-started.md, "Resuming a run"), unless `accept_config_change` says a change is meant."""
    recorded = run_dir.recorded_config()
    if recorded is None or not run_dir.has_work() or config.accept_config_change:
        return
    changes = config_changes(recorded, config.model_dump(mode="json"))
    if changes:
        raise ConfigError(
            f"run_dir: {run_dir.path} was run with another config; these fields change what a rollout or a step "
            "means (rerun with --accept-config-change, or set accept_config_change: true, if the change is meant; "
            'docs/getting-started.md, "Resuming a run"):\n' + "\n".join(f"  {line}" for line in changes)
        )


def check_devices(config: RunConfig) -> None:
    """A local run (no ray_address) asks only for devices this machine has: Ray would wait for a GPU forever."""
    if config.ray_address:
        return
    asked = (("rollout.device", config.rollout.device), ("train.device", config.train.device))
    cuda = [(field, device) for field, device in asked if device.startswith("cuda")]
    if not cuda:
        return
    import torch

    if not torch.cuda.is_available():
        field, device = cuda[0]
        raise ConfigError(
            f"{field}={device}: this machine has no CUDA device (torch.cuda.is_available() is false), and no "
            "ray_address names a cluster that has one"
        )


def check_ray_address(address: str | None) -> None:
    """A named Ray cluster answers on its port within seconds (Ray itself retries for minutes)."""
    if not address or address in ("auto", "local"):
        return
    parts = urlsplit(address if "://" in address else f"ray://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host, port = None, None
    if not host or not port:
        raise ConfigError(f"ray_address: {address!r} is not host:port or ray://host:port")
    try:
        socket.create_connection((host, port), timeout=RAY_CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ConfigError(
            f"ray_address: nothing answers at {host}:{port} within {RAY_CONNECT_TIMEOUT_S:g} s ({exc.strerror or exc})"
        ) from None


def load_model_files(path: str) -> tuple[Any, Any]:
    """(tokenizer, config) of a Hugging Face model directory. Errors name model.path, not the library's guesses (a
    missing directory reads to transformers as a Hub repo id)."""
    from transformers import AutoConfig, AutoTokenizer

    directory = Path(path)
    if not directory.is_dir():
        what = "is a file" if directory.exists() else "does not exist"
        raise ConfigError(
            f"model.path: {path} {what}; give a Hugging Face model directory (config.json, weights, tokenizer)"
        )
    if not (directory / "config.json").is_file():
        raise ConfigError(f"model.path: {path} has no config.json; it is not a Hugging Face model directory")
    loaded = []
    for what, load in (("tokenizer", AutoTokenizer.from_pretrained), ("config", AutoConfig.from_pretrained)):
        try:
            loaded.append(load(path))
        except (OSError, ValueError, KeyError, json.JSONDecodeError, ImportError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"model.path: the {what} of {path} does not load: {first}") from None
    return loaded[0], loaded[1]
