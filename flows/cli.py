"""`miles` command line: parse and validate the config first, import the heavy modules after."""

from __future__ import annotations

import argparse
import getpass
import sys

from miles.config import MID_RUN_FIELDS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="miles", description="RL post-training as Prefect flows.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="run an RL flow")
    run.add_argument("flow", help="which flow graph (miles.graphs; an unknown name lists them)")
    run.add_argument("--config", help="YAML config file (default: the embedded tiny model on addition)")
    run.add_argument("--run-dir", help="run directory (an existing one resumes)")
    run.add_argument("--num-rollout", type=int, help="total rollouts of the run")
    run.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="a.b=value", help="override a config field"
    )
    run.add_argument(
        "--accept-config-change",
        action="store_true",
        help="resume a run whose config changed in fields that change what a rollout or a step means",
    )
    plan = commands.add_parser(
        "plan", help="where each trainer rank and engine will land, and the weight transport, before a run starts"
    )
    plan.add_argument("--config", help="YAML config file (default: the embedded tiny model on addition)")
    plan.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="a.b=value", help="override a config field"
    )
    plan.add_argument(
        "--simulate",
        metavar="NODESxGPUS",
        help="plan on a Ray cluster of this shape started here with GPUs that do not exist (e.g. 1x8, 2x8), instead "
        "of the cluster the config's ray_address names (or a new local one)",
    )
    plan.add_argument(
        "--gpu-memory-gib", type=float, default=80.0, help="memory of each GPU, for the budget (default: 80, an H100)"
    )
    tenant = commands.add_parser("tenant", help="submit, withdraw or list the adapters of a multi-LoRA run")
    actions = tenant.add_subparsers(dest="action", required=True)
    submit = actions.add_parser("submit", help="add an adapter; it joins the run at its next iteration boundary")
    submit.add_argument("run_dir", help="the multi-LoRA run's directory")
    submit.add_argument("--adapter", help="YAML file of the adapter (AdapterConfig: name, data, num_steps, ...)")
    submit.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="a.b=value", help="set an adapter field"
    )
    withdraw = actions.add_parser("withdraw", help="save and retire an adapter at its next iteration boundary")
    withdraw.add_argument("run_dir", help="the multi-LoRA run's directory")
    withdraw.add_argument("name", help="the adapter's name")
    withdraw.add_argument("--reason", default="", help="recorded with the withdrawal")
    listing = actions.add_parser("list", help="each adapter of the run: its group, rollouts trained, state")
    listing.add_argument("run_dir", help="the multi-LoRA run's directory")
    pause = commands.add_parser(
        "pause", help="pause a running flow run after the iteration in flight (its form then takes new values)"
    )
    pause.add_argument("flow_run_id", help="the flow run's id (the UI shows it; `prefect flow-run ls`)")
    pause.add_argument(
        "--release", action="store_true", help="stop the engines and the trainer while paused (they start again)"
    )
    pause.add_argument("--reason", default="", help="shown in the flow run's state")
    resume = commands.add_parser("resume", help="resume a paused flow run, changing values from the next rollout on")
    resume.add_argument("flow_run_id")
    resume.add_argument(
        "--set",
        dest="values",
        action="append",
        default=[],
        metavar="name=value",
        help=f"a value of the pause form: {', '.join(MID_RUN_FIELDS)}",
    )
    resume.add_argument("--by", default=getpass.getuser(), help="who changes the values (recorded; default: you)")
    resume.add_argument("--reason", default="", help="why (recorded)")
    cancel = commands.add_parser("cancel", help="end a running flow run after the iteration in flight; it resumes")
    cancel.add_argument("flow_run_id")
    cancel.add_argument("--reason", default="", help="shown in the flow run's state")
    approve = commands.add_parser("approve", help="answer an rl-pipeline run waiting for approval")
    approve.add_argument("flow_run_id")
    approve.add_argument("--reject", action="store_true", help="do not promote the checkpoint")
    approve.add_argument("--by", default=getpass.getuser(), help="who decides (recorded; default: you)")
    approve.add_argument("--reason", default="", help="why (recorded)")
    lineage = commands.add_parser("lineage", help="what made a checkpoint: rollouts, data rows, config, code")
    lineage.add_argument("run_dir")
    lineage.add_argument("rollout_id", nargs="?", type=int, help="the checkpoint's rollout (default: the latest)")
    lineage.add_argument("--json", action="store_true", help="print it as JSON")
    automations = commands.add_parser("automations", help="the automations miles ships (Prefect server)")
    automations.add_argument("action", choices=["apply"], help="create them, or update those of the same name")
    return parser


def _lineage(args: argparse.Namespace) -> int:
    import json

    from miles.lineage import describe, markdown

    try:
        lineage = describe(args.run_dir, args.rollout_id)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(lineage, indent=2) if args.json else markdown(lineage))
    return 0


def _plan(args: argparse.Namespace) -> int:
    """`miles plan`: seats take the run's resource requests on a Ray cluster, and the table says where they landed."""
    import contextlib
    import re

    from miles.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.overrides)
        shape = re.fullmatch(r"(\d+)x(\d+)", args.simulate or "")
        if args.simulate and not shape:
            raise ConfigError(f"--simulate {args.simulate!r}: give NODESxGPUS, e.g. 1x8")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    import ray

    from miles.cluster.actors import ensure_ray
    from miles.cluster.placement import plan_placement, ray_actors, simulated_cluster
    from miles.train.algorithms import resolve_estimator

    with contextlib.ExitStack() as stack:
        address = config.ray_address
        if shape:
            address = stack.enter_context(simulated_cluster(int(shape[1]), int(shape[2])))
        try:
            critic = resolve_estimator(config.algo).needs_critic
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        ensure_ray(address, actors=ray_actors(config, critic))
        stack.callback(ray.shutdown)
        try:
            record = plan_placement(config, critic)
        except (ValueError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    print(record.table())
    return _memory_budget(config, args.gpu_memory_gib)


def _memory_budget(config, gpu_gib: float) -> int:
    """The memory each GPU holds (miles.cluster.memory_budget), where the run is on GPUs and its model's config.json is here."""
    from pathlib import Path

    from miles.cluster.memory_budget import ModelShape, budget
    from miles.engines import resolve_engine

    if not (config.rollout.device.startswith("cuda") or config.train.device.startswith("cuda")):
        return 0
    model_dir = Path(config.model.path) if config.model.path else None
    if model_dir is None or not (model_dir / "config.json").is_file():
        print(f"memory: no budget, model.path={config.model.path} has no config.json here")
        return 0
    try:
        served = resolve_engine(config.rollout.engine).served_dtype(str(model_dir), config.rollout)
        gpus = budget(config, ModelShape.read(model_dir), served, gpu_gib)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for gpu in gpus:
        print(f"memory, {gpu.describe(gpu_gib * 2**30)}")
    return 0


def _automations() -> int:
    from control.automations import apply_automations

    for name in apply_automations():
        print(f"applied: {name}")
    return 0


def _control(args: argparse.Namespace) -> int:
    """`miles pause|resume|cancel|approve FLOW_RUN_ID`: through the Prefect API that PREFECT_API_URL names."""
    from uuid import UUID

    import yaml

    from control.requests import answer_approval, ask_cancel, ask_pause, resume
    from miles.config import ConfigError

    flow_run_id = UUID(args.flow_run_id)
    try:
        if args.command == "pause":
            ask_pause(flow_run_id, args.release, args.reason)
            print(f"flow run {flow_run_id} pauses after the iteration in flight")
        elif args.command == "cancel":
            ask_cancel(flow_run_id, args.reason)
            print(f"flow run {flow_run_id} ends after the iteration in flight")
        elif args.command == "approve":
            answer_approval(flow_run_id, not args.reject, args.by, args.reason)
            print(f"flow run {flow_run_id}: checkpoint {'rejected' if args.reject else 'approved'}")
        else:
            values = {}
            for text in args.values:
                name, sep, raw = text.partition("=")
                if not sep:
                    raise ConfigError(f"--set {text!r} is not of the form name=value")
                values[name] = yaml.safe_load(raw)
            resume(flow_run_id, values, args.by, args.reason)
            print(f"flow run {flow_run_id} resumed" + (f" with {values}" if values else ""))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _tenant(args: argparse.Namespace) -> int:
    """`miles tenant ...`: the run directory is the run's mailbox; no Prefect needed."""
    from miles.config import ConfigError, load_adapter_config
    from miles.multi_lora.admin import adapter_states, submit_tenant, withdraw_adapter

    try:
        if args.action == "submit":
            adapter = load_adapter_config(args.adapter, args.overrides)
            submit_tenant(args.run_dir, adapter)
            print(f"adapter {adapter.name} submitted: it joins the run at its next iteration boundary")
        elif args.action == "withdraw":
            withdraw_adapter(args.run_dir, args.name, args.reason)
            print(f"adapter {args.name} withdrawn: it is saved and retired at its next iteration boundary")
        else:
            for row in adapter_states(args.run_dir):
                print(
                    f"{row['name']:<20} {row['origin']:<7} group {row['trainer_group']:<12} "
                    f"{row['trained']:>5}/{row['num_steps']:<5} {row['state']}"
                )
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "tenant":
        return _tenant(args)
    if args.command in ("pause", "resume", "cancel", "approve"):
        return _control(args)
    if args.command == "automations":
        return _automations()
    if args.command == "lineage":
        return _lineage(args)
    if args.command == "plan":
        return _plan(args)
    from miles.config import ConfigError, load_config
    from miles.graphs import GRAPHS

    if args.flow not in GRAPHS:
        print(f"error: no flow graph {args.flow!r}; choose from {', '.join(GRAPHS)}", file=sys.stderr)
        return 2
    try:
        config = load_config(
            args.config,
            args.overrides,
            run_dir=args.run_dir,
            num_rollout=args.num_rollout,
            accept_config_change=args.accept_config_change or None,
        )
        GRAPHS[args.flow].check(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from flows.registry import FLOWS
    from flows.runtime import configure_prefect, quiet_config_errors, start_ephemeral_api

    configure_prefect()
    start_ephemeral_api()
    with quiet_config_errors():
        state = FLOWS[args.flow](config, return_state=True)
    if not state.is_completed():
        error = state.result(raise_on_failure=False) if state.is_failed() else None
        if isinstance(error, ConfigError):  # found once the run had started: the traceback is in the flow run's log
            print(f"error: {error}", file=sys.stderr)
            return 2
        print(f"flow run ended {state.name}: {state.message}", file=sys.stderr)
        return 1
    result = state.result()
    summaries = result if args.flow == "multi-lora" else {"": result}
    if not any(s["rollouts_trained"] for s in summaries.values()):
        print(f"nothing to do: {config.run_dir} has trained all its rollouts (raise the rollout count to go on)")
        return 0
    for name, summary in summaries.items():
        prefix = f"[{name}] " if name else ""
        print(
            f"{prefix}done: {summary['rollouts_trained']} rollouts trained in {summary['run_dir']}; "
            f"final reward {summary['final_reward_mean']:.3f}"
        )
        for dataset, evaluations in summary["eval"].items():
            first, last = evaluations[0], evaluations[-1]
            print(
                f"{prefix}eval {dataset} ({first['prompts']} prompts), mean reward: {first['reward_mean']:.3f} "
                f"(rollout {first['rollout_id']}) -> {last['reward_mean']:.3f} (rollout {last['rollout_id']})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
