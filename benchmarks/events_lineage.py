"""Events and lineage: the rl-sync flow with logging.events and logging.lineage on vs off, per iteration.

Two run directories at the default config (the embedded task), each trained in blocks of `--iterations` rollouts, one
flow run per block (iterations_per_run), the two sides alternating (off, on, off, on, ...) so that drift hits both.
The embedded API runs as `miles run` starts it (no event persister, no triggers: the events are sent, as they are to
any API). A block's iteration time is the mean gap between its iterations' `finished_at`, the first iteration left
out (the flow run's start); the last gap holds the block's closing checkpoint, whose lineage hashes the block's
rollouts.

Last line: `events_lineage_ratio <on seconds per iteration / off seconds per iteration>`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from benchmarks.smoke import TINY_RUN, parse_args
from flows.runtime import configure_prefect

configure_prefect()

from flows.runtime import start_ephemeral_api  # noqa: E402
from flows.sync_rl import sync_rl  # noqa: E402
from miles.cluster.actors import ensure_ray  # noqa: E402
from miles.config import load_config  # noqa: E402
from miles.state.run_dir import RunDir  # noqa: E402


def _block(run_dir: Path, on: bool, first: int, iterations: int, overrides: list[str]) -> list[float]:
    switches = [f"logging.events={str(on).lower()}", f"logging.lineage={str(on).lower()}"]
    config = load_config(
        None, overrides + switches, run_dir=str(run_dir), num_rollout=first + iterations, iterations_per_run=iterations
    )
    state = sync_rl(config, return_state=True)
    assert state.is_completed(), state.message
    finished = [r["finished_at"] for r in RunDir(run_dir).metrics() if r["rollout_id"] >= first]
    return [b - a for a, b in zip(finished, finished[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="blocks per side")
    parser.add_argument("--iterations", type=int, default=20, help="iterations per block (one flow run)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(parser, rounds=1, iterations=3, overrides=TINY_RUN)
    start_ephemeral_api()
    ensure_ray(None, 2)
    gaps: dict[bool, list[float]] = {False: [], True: []}
    per_block: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="events-lineage-") as workdir:
        for round_ in range(args.rounds):
            for on in (False, True):
                run_dir = Path(workdir) / ("on" if on else "off")
                block = _block(run_dir, on, round_ * args.iterations, args.iterations, args.overrides)
                gaps[on] += block
                per_block[on].append(statistics.mean(block))
                print(
                    f"round {round_}, events and lineage {'on ' if on else 'off'}: {per_block[on][-1]:.4f} s/iteration"
                )
    off, on = statistics.mean(gaps[False]), statistics.mean(gaps[True])
    pairs = [b / a for a, b in zip(per_block[False], per_block[True], strict=True)]
    print(f"off {off:.4f} s/iteration, on {on:.4f} s/iteration; per-round ratios {min(pairs):.3f}-{max(pairs):.3f}")
    print(f"events_lineage_ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
