"""Orchestration overhead: a Prefect-flow iteration vs a plain-loop iteration over the same actors and work.

Both drive one RLRun (the same engine and trainer actors) at the default config: the plain loop calls
`miles.schedules.sync_iteration` over the plain steps, the flow the same schedule over the sync flow's tasks.
Blocks alternate (plain, flow, plain, flow, ...) so that drift in the work hits both sides. The flow side runs
against Prefect's ephemeral API in this process's machine, so the server's CPU per task run competes with the
work, as it does for a user. Each flow block is a flow run of its own, its start in its time; the wait for the API to
store the task history comes once per process, at exit, so it is timed once after the last block and added to the
flow side's total.

Each side's time is also split by where it goes: inside the RLRun calls that both sides make (generate, get, train,
sync_weights), between them (for the flow, Prefect's task engine on the critical path), and before the first call and
after the last one of each block (for the flow, the flow run's start and end).

Last line: `overhead_ratio <flow seconds per iteration / plain seconds per iteration>`.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace

from benchmarks.smoke import TINY_RUN, parse_args
from flows.runtime import configure_prefect

configure_prefect()

from prefect import flow, runtime  # noqa: E402

from flows.runtime import start_ephemeral_api  # noqa: E402
from miles import schedules  # noqa: E402
from miles.config import load_config  # noqa: E402
from miles.loop import plain_steps  # noqa: E402
from miles.run import RLRun  # noqa: E402
from tasks import STEPS, generate  # noqa: E402
from tasks.history import finished_task_runs, wait_for_task_history  # noqa: E402


@flow(name="overhead-probe")
def probe(run: RLRun, rollout_ids: list[int], generate_tags: list[str] | None = None) -> int:
    """The sync flow's iterations (its schedule over its tasks), without its report; returns its task runs."""
    steps = replace(STEPS, generate=generate.with_options(tags=generate_tags)) if generate_tags else STEPS
    for rollout_id in rollout_ids:
        schedules.sync_iteration(run, steps, rollout_id)
    return finished_task_runs(runtime.flow_run.id)


TIMED_CALLS = ("generate", "get", "train", "sync_weights", "save_checkpoint")


@dataclass
class CallClock:
    """Start and end times of the RLRun calls both sides make, to split a block's time by where it goes."""

    spans: list[tuple[float, float]] = field(default_factory=list)

    def wrap(self, run: RLRun) -> None:
        for name in TIMED_CALLS:
            setattr(run, name, self._timed(getattr(run, name)))

    def _timed(self, call):
        @functools.wraps(call)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.spans.append((started, time.perf_counter()))

        return timed

    def split(self, started: float, ended: float, iterations: int) -> dict[str, float]:
        """Seconds per iteration of the block [started, ended]: inside the calls, between them, and at its ends."""
        spans = [(s, e) for s, e in self.spans if started <= s and e <= ended]
        inside = sum(e - s for s, e in spans)
        ends = (spans[0][0] - started) + (ended - spans[-1][1])
        return {
            "inside": inside / iterations,
            "between": (ended - started - inside - ends) / iterations,
            "ends": ends / iterations,
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=20, help="iterations per block")
    parser.add_argument("--rounds", type=int, default=2, help="plain+flow block pairs")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(parser, iterations=2, rounds=1, overrides=TINY_RUN)

    per_block = args.iterations
    total = per_block * (2 * args.rounds + 1)
    # save_interval past the end: no checkpoint inside the measured blocks.
    config = load_config(
        None,
        args.overrides,
        run_dir=tempfile.mkdtemp(prefix="overhead-"),
        num_rollout=total + 1,
        save_interval=total + 1,
    )
    start_ephemeral_api()  # as `miles run` starts it
    clock = CallClock()
    with RLRun(config) as run, plain_steps() as steps:
        clock.wrap(run)
        ids = iter(run.rollout_ids())
        schedules.sync_iteration(run, steps, next(ids))  # warm the actors
        probe(run, [next(ids) for _ in range(per_block - 1)])  # warm the ephemeral API
        plain_times, flow_times, task_runs = [], [], 0
        plain_splits, flow_splits = [], []
        for _ in range(args.rounds):
            block = [next(ids) for _ in range(per_block)]
            started = time.perf_counter()
            for rollout_id in block:
                schedules.sync_iteration(run, steps, rollout_id)
            ended = time.perf_counter()
            plain_times.append((ended - started) / per_block)
            plain_splits.append(clock.split(started, ended, per_block))
            block = [next(ids) for _ in range(per_block)]
            started = time.perf_counter()
            task_runs += probe(run, block)
            ended = time.perf_counter()
            flow_times.append((ended - started) / per_block)
            flow_splits.append(clock.split(started, ended, per_block))
        started = time.perf_counter()
        wait_for_task_history()
        history_wait = time.perf_counter() - started

    plain = statistics.mean(plain_times)
    flowed = statistics.mean(flow_times) + history_wait / (per_block * args.rounds)
    per_task_ms = 1000 * (flowed - plain) * per_block * args.rounds / task_runs
    print(f"iterations per block      {per_block} x {args.rounds} rounds")
    print(f"plain loop  s/iteration   {plain:.4f}  (blocks: {', '.join(f'{t:.4f}' for t in plain_times)})")
    print(f"prefect flow s/iteration  {flowed:.4f}  (blocks: {', '.join(f'{t:.4f}' for t in flow_times)})")
    print(f"history wait at exit s    {history_wait:.3f}  (once, in the flow side's mean)")
    print(f"per-task overhead ms      {per_task_ms:.1f}")
    pair_ratios = [f / p for p, f in zip(plain_times, flow_times, strict=True)]
    spread = (
        f"  (mean {statistics.mean(pair_ratios):.3f}, standard error "
        f"{statistics.stdev(pair_ratios) / len(pair_ratios) ** 0.5:.3f})"
        if len(pair_ratios) > 1
        else ""
    )
    print(f"pair ratios               {', '.join(f'{r:.3f}' for r in pair_ratios)}{spread}")
    print("ms per iteration          plain    flow   flow - plain")
    for part, meaning in [
        ("inside", "in the RLRun calls"),
        ("between", "between the calls (task engine)"),
        ("ends", "before the first, after the last"),
    ]:
        plain_ms = 1000 * statistics.mean(split[part] for split in plain_splits)
        flow_ms = 1000 * statistics.mean(split[part] for split in flow_splits)
        print(f"  {meaning:34s} {plain_ms:7.1f} {flow_ms:7.1f} {flow_ms - plain_ms:+7.1f}")
    exit_ms = 1000 * history_wait / (per_block * args.rounds)
    print(f"  {'history wait at exit':34s} {0.0:7.1f} {exit_ms:7.1f} {exit_ms:+7.1f}")
    print(f"overhead_ratio {flowed / plain:.3f}")


if __name__ == "__main__":
    main()
