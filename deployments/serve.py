"""Serve the RL flows as deployments from one process, each with an optional schedule.

    python -m deployments.serve [--config FILE] [--set a.b=value ...] [--allow-module PKG ...] [--allow-launch-settings]
                                [--allow-root DIR ...] [--allow-ray-address ADDRESS ...]
                                [--sync-interval SECONDS | --sync-cron EXPR] [--async-interval SECONDS | --async-cron EXPR]
                                [--fully-async-interval SECONDS | --fully-async-cron EXPR]
                                [--multi-lora-interval SECONDS | --multi-lora-cron EXPR]

Deployments `rl-sync/tiny`, `rl-async/tiny`, `rl-fully-async/tiny` and `rl-multi-lora/tiny` run the config (default:
configs/tiny.yaml beside this file), each in its own run directory (`<run_dir>-<name>`), at most one flow run at a
time. With `iterations_per_run` set, each scheduled run trains that many rollouts (per adapter, for multi-LoRA) and
exits; the next resumes. `rl-eval/tiny` evaluates every checkpoint any run saves, triggered by its event
(flows/eval.py). `rl-pipeline/tiny` trains, evaluates and promotes on approval (in `<run_dir>-pipeline`, to
`<run_dir>-promoted`); `rl-sweep/tiny` runs a grid of variants (by default the lr halved, as is and doubled, in
`<run_dir>-sweep`). `rl-tenant-submit/tiny` and `rl-tenant-withdraw/tiny` add an adapter to, and withdraw one
from, the multi-LoRA deployment's run (flows/tenants.py).

A run's config may name code by import path (`data.reward: pkg.mod:fn`, custom algorithms, environments, generate
functions) only in `miles` and in the modules given by --allow-module, and its launch settings (the SGLang server's
`rollout.sglang.python`, `server_module`, `extra_args`: programs a worker starts) must be the config's own unless
--allow-launch-settings is given. With --allow-root, the files and directories it names (run_dir, model.path, data
paths) must lie under one of those roots; with --allow-ray-address, its ray_address must be unset or one of those.
Anything else fails before work (flows.runtime.check_deployment_run), whoever started the run and with whatever
parameters.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flows.registry import FLOWS

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "tiny.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML run config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="a.b=value")
    parser.add_argument(
        "--allow-module",
        dest="allowed_modules",
        action="append",
        default=[],
        metavar="PKG",
        help="a package or module whose code a run's config may name by import path (miles is always allowed)",
    )
    parser.add_argument(
        "--allow-launch-settings",
        action="store_true",
        help="a run may change the settings that choose the programs a worker starts (rollout.sglang.python, "
        "server_module, extra_args); without it they stay the config's",
    )
    parser.add_argument(
        "--allow-root",
        dest="allowed_roots",
        action="append",
        default=[],
        metavar="DIR",
        help="a directory under which a run's files may lie (run_dir, model.path, data paths); unset: anywhere",
    )
    parser.add_argument(
        "--allow-ray-address",
        dest="allowed_ray_addresses",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="a Ray cluster a run may name in ray_address; unset: any",
    )
    for name in FLOWS:
        when = parser.add_mutually_exclusive_group()
        when.add_argument(f"--{name}-interval", type=float, metavar="SECONDS", help=f"schedule rl-{name} every SECONDS")
        when.add_argument(f"--{name}-cron", metavar="EXPR", help=f"schedule rl-{name} by a cron expression")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from control.policy import (
        ALLOW_LAUNCH_VARIABLE,
        ALLOWED_MODULES_VARIABLE,
        ALLOWED_RAY_ADDRESSES_VARIABLE,
        ALLOWED_ROOTS_VARIABLE,
        ImportNotAllowed,
        PlaceNotAllowed,
        check_allowed_modules,
        check_allowed_places,
    )
    from flows.runtime import configure_prefect
    from miles.config import ConfigError, load_config

    try:
        base = load_config(args.config, args.overrides)
        check_allowed_modules(
            base.import_paths(), args.allowed_modules, f"{args.config} (allow more with --allow-module)"
        )
        for name in FLOWS:  # each deployment's own run directory
            check_allowed_places(
                base.model_copy(update={"run_dir": f"{base.run_dir}-{name}"}),
                args.allowed_roots,
                args.allowed_ray_addresses,
                f"{args.config} (allow more with --allow-root, --allow-ray-address)",
            )
    except (ConfigError, ImportNotAllowed, PlaceNotAllowed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    configure_prefect()
    from prefect import serve

    # Served flow runs inherit this process's environment; a run cannot set it (no work pool, no job variables).
    os.environ[ALLOWED_MODULES_VARIABLE] = ",".join(args.allowed_modules)
    os.environ[ALLOW_LAUNCH_VARIABLE] = "1" if args.allow_launch_settings else "0"
    os.environ[ALLOWED_ROOTS_VARIABLE] = ",".join(args.allowed_roots)
    os.environ[ALLOWED_RAY_ADDRESSES_VARIABLE] = ",".join(args.allowed_ray_addresses)

    deployments = []
    for name, rl_flow in FLOWS.items():
        config = base.model_copy(update={"run_dir": f"{base.run_dir}-{name}"})
        option = name.replace("-", "_")
        deployments.append(
            rl_flow.to_deployment(
                name="tiny",
                parameters={"config": config.model_dump(mode="json")},
                interval=getattr(args, f"{option}_interval"),
                cron=getattr(args, f"{option}_cron"),
                tags=["rl", name],
                concurrency_limit=1,  # one flow run per deployment, so per run directory
                description=f"rl-{name} on {args.config}",
            )
        )
    from prefect.events import DeploymentEventTrigger

    from control.events import CHECKPOINT
    from flows.eval import rl_eval

    deployments.append(
        rl_eval.to_deployment(
            name="tiny",
            triggers=[
                DeploymentEventTrigger(
                    expect={CHECKPOINT},
                    match={"miles.checkpoint-kind": "model"},
                    parameters={
                        "checkpoint": "{{ event.resource['miles.checkpoint-path'] }}",
                        "training_flow_run_id": "{{ event.resource['miles.flow-run-id'] }}",
                    },
                )
            ],
            tags=["rl", "eval"],
            concurrency_limit=1,  # one set of evaluation engines at a time; the others queue
            description="evaluate each checkpoint a run saves, in a flow run of its own",
        )
    )
    from flows.pipeline import rl_pipeline
    from flows.sweep import rl_sweep

    deployments.append(
        rl_pipeline.to_deployment(
            name="tiny",
            parameters={
                "config": base.model_copy(update={"run_dir": f"{base.run_dir}-pipeline"}).model_dump(mode="json"),
                "promote_to": f"{base.run_dir}-promoted",
            },
            tags=["rl", "pipeline"],
            concurrency_limit=1,
            description="train, evaluate, wait for approval, promote the checkpoint",
        )
    )
    deployments.append(
        rl_sweep.to_deployment(
            name="tiny",
            parameters={
                "config": base.model_copy(update={"run_dir": f"{base.run_dir}-sweep"}).model_dump(mode="json"),
                "grid": {"train.lr": [base.train.lr / 2, base.train.lr, base.train.lr * 2]},
            },
            tags=["rl", "sweep"],
            concurrency_limit=1,
            description="config variants as child flow runs, and their comparison",
        )
    )
    from flows.tenants import submit_tenant, withdraw_tenant

    multi_lora_run_dir = f"{base.run_dir}-multi-lora"
    for tenant_flow in (submit_tenant, withdraw_tenant):
        deployments.append(
            tenant_flow.to_deployment(
                name="tiny",
                parameters={"run_dir": multi_lora_run_dir},
                tags=["rl", "multi-lora", "tenant"],
                description=f"{tenant_flow.name} for the multi-LoRA run in {multi_lora_run_dir}",
            )
        )
    serve(*deployments)
    return 0


if __name__ == "__main__":
    sys.exit(main())
