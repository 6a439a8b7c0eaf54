"""What a deployment may run, decided in one place: the modules a config may import from (miles.* always), the files
and directories it may name, the Ray clusters it may reach, and the programs its workers may start. A flow started
from a deployment is checked against what the deployment was defined with (`check_deployment_run`); the serving
process (deployments/serve.py) checks its own configs with the same rules before it serves them."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

ALWAYS_ALLOWED = ("miles",)  # the built-ins


def module_allowed(module: str, allowed: Sequence[str]) -> bool:
    """Whether `module` is one of the allowed packages or modules, or inside one."""
    return any(module == name or module.startswith(f"{name}.") for name in (*ALWAYS_ALLOWED, *allowed))


def check_allowed_modules(import_paths: dict[str, str], allowed: Sequence[str], where: str) -> None:
    """Refuse, before any work, every import path outside the allowed modules: one line per field."""
    refused = [
        f"  {field}: module {spec.partition(':')[0]!r} is not allowed"
        for field, spec in import_paths.items()
        if not module_allowed(spec.partition(":")[0], allowed)
    ]
    if refused:
        allowed_list = ", ".join((*ALWAYS_ALLOWED, *allowed))
        raise ImportNotAllowed(f"{where}: imports are allowed only from {allowed_list}:\n" + "\n".join(refused))


class ImportNotAllowed(ValueError):
    """A config names code that the place running it does not allow."""


ALLOWED_MODULES_VARIABLE = "MILES_ALLOWED_MODULES"
ALLOW_LAUNCH_VARIABLE = "MILES_ALLOW_LAUNCH_SETTINGS"
ALLOWED_ROOTS_VARIABLE = "MILES_ALLOWED_ROOTS"
ALLOWED_RAY_ADDRESSES_VARIABLE = "MILES_ALLOWED_RAY_ADDRESSES"


def allowed(env: Mapping[str, str], variable: str) -> list[str]:
    """What `variable` allows in `env`: its comma-separated entries (none when it is unset)."""
    return [name.strip() for name in env.get(variable, "").split(",") if name.strip()]


class PlaceNotAllowed(ValueError):
    """A deployment run names a file, directory or Ray cluster outside what its deployment allows."""


def check_allowed_places(config, roots: list[str], ray_addresses: list[str], where: str) -> None:
    """With allowed roots, every file and directory the config names (run_dir, model.path, data paths) lies inside
    one of them, once symbolic links are followed; with allowed Ray addresses, ray_address is unset (a local Ray) or
    one of them. An empty list allows anything."""
    refused = []
    if roots:
        resolved_roots = [Path(root).resolve() for root in roots]
        for field, value in config.file_paths().items():
            if not any(Path(value).resolve().is_relative_to(root) for root in resolved_roots):
                refused.append(f"  {field}: {value} is outside the allowed roots {', '.join(roots)}")
    if ray_addresses and config.ray_address and config.ray_address not in ray_addresses:
        refused.append(f"  ray_address: {config.ray_address} is not one of {', '.join(ray_addresses)}")
    if refused:
        raise PlaceNotAllowed(
            f"{where}: these settings name places the deployment does not allow:\n" + "\n".join(refused)
        )


class LaunchNotAllowed(ValueError):
    """A deployment run asks to start programs that its deployment does not allow."""


def check_deployment_run(config) -> None:
    """A flow run started from a deployment imports only the modules that deployment allows (miles.* always), reads
    and writes only under the roots it allows and reaches only the Ray clusters it allows (when it names any), and
    starts only the programs its deployment starts: its launch settings (RunConfig.launch_settings: the SGLang
    server's Python, module and flags) are the deployment's own, unless the deployment allows a run to change them
    (MILES_ALLOW_LAUNCH_SETTINGS=1).

    Anyone who can reach the API can start a deployment with any parameters, and the config names code by import
    path and programs by launch setting; what is allowed is what the deployment was defined with, never the run's own
    parameters or job variables. A work-pool deployment (prefect.yaml) keeps it in its stored job variables (a run's
    --job-variable reaches the process environment, not that record); a served one (deployments/serve.py
    --allow-module, --allow-launch-settings) in the environment of the serving process, which its flow runs inherit
    and which a run cannot change. A flow called directly (`miles run`, Python) keeps full freedom.
    """
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    from miles.config import RunConfig

    context = FlowRunContext.get()
    deployment_id = context.flow_run.deployment_id if context and context.flow_run else None
    if deployment_id is None:
        return
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment(deployment_id)
    env = (deployment.job_variables.get("env") or {}) if deployment.work_pool_name else os.environ
    where = f"deployment {context.flow.name}/{deployment.name}"
    check_allowed_modules(config.import_paths(), allowed(env, ALLOWED_MODULES_VARIABLE), where)
    check_allowed_places(
        config, allowed(env, ALLOWED_ROOTS_VARIABLE), allowed(env, ALLOWED_RAY_ADDRESSES_VARIABLE), where
    )
    if env.get(ALLOW_LAUNCH_VARIABLE) == "1":
        return
    defined = RunConfig.model_validate(deployment.parameters.get("config") or {}).launch_settings()
    changed = [
        f"  {field}: {value!r} (the deployment's: {defined[field]!r})"
        for field, value in config.launch_settings().items()
        if value != defined[field]
    ]
    if changed:
        raise LaunchNotAllowed(
            f"{where}: these settings choose programs the workers start, and a run of this deployment may not change "
            f"them ({ALLOW_LAUNCH_VARIABLE}=1 in the deployment allows it):\n" + "\n".join(changed)
        )
