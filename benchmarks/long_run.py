"""Long runs: what grows with the number of iterations in one flow run of rl-sync.

One flow run of `--iterations` (default 2000) at a small batch (4 prompts x 2 samples, one optimizer step of 8
samples per rollout, no evaluation, a checkpoint every 500), engine and trainer one torch thread each, against the
embedded ephemeral API as `miles run sync` uses it. A thread samples the flow process's resident memory every 0.5 s;
each iteration's end comes from metrics.jsonl. Reported: the mean iteration time and RSS over the first and the last
`--window` (200) iterations, the SQLite database's size, and, where Debian's Chromium is installed, how long the flow
run's page takes to list its task runs in the Prefect UI (a server started on the same database afterwards).

Second-to-last line: `rss_growth_mib_per_1000 <MiB per 1000 iterations, first-window to last-window mean>`.
Last line: `long_run_growth <last-window s/iteration / first-window s/iteration>`.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.prefect_server import prefect_server
from benchmarks.smoke import UNTRAINED_MODEL, parse_args

SMALL_BATCH = [
    "rollout.rollout_batch_size=4",
    "rollout.n_samples_per_prompt=2",
    "train.global_batch_size=8",
    "train.micro_batch_size=8",
    "rollout.num_threads=1",
    "train.num_threads=1",
    "eval.datasets=[]",
    "save_interval=500",
]
CHROMIUM = Path("/usr/bin/chromium")
TASK_RUN_NAME = re.compile(r"^(generate|get|train_step|sync_weights)\[rollout=\d+\]$")


def _rss_mib() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class MemorySampler(threading.Thread):
    def __init__(self):
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            self.samples.append((time.time(), _rss_mib()))

    def mean_between(self, start: float, end: float) -> float:
        return statistics.mean(rss for t, rss in self.samples if start <= t <= end)


def ui_task_list_seconds(flow_run_id: str) -> float:
    """Start a Prefect server on this PREFECT_HOME and time the flow run's page until its Task Runs tab lists task
    runs."""
    from playwright.sync_api import sync_playwright

    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    with prefect_server(env, Path(os.environ["PREFECT_HOME"]) / "ui-server.log") as api:
        ui = api.removesuffix("/api")
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=str(CHROMIUM),
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"],
            )
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                started = time.perf_counter()
                page.goto(f"{ui}/runs/flow-run/{flow_run_id}")
                page.get_by_text("Task Runs", exact=True).click(timeout=120_000)
                page.get_by_text(TASK_RUN_NAME).first.wait_for(timeout=120_000)
                listed = time.perf_counter() - started
            finally:
                browser.close()
    return listed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--window", type=int, default=200, help="iterations of the first and the last mean")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    # A window of 20 iterations spans a few of the memory sampler's 0.5 s ticks.
    args = parse_args(parser, iterations=40, window=20, overrides=UNTRAINED_MODEL)
    if args.iterations < 2 * args.window:
        parser.error(f"--iterations must be at least twice --window ({2 * args.window})")

    home = Path(tempfile.mkdtemp(prefix="long-run-"))
    os.environ["PREFECT_HOME"] = str(home / "prefect")
    from flows.runtime import configure_prefect, start_ephemeral_api

    configure_prefect()
    start_ephemeral_api()  # as `miles run` starts it
    from flows.sync_rl import sync_rl
    from miles.config import load_config
    from miles.state.run_dir import RunDir
    from tasks.history import wait_for_task_history

    config = load_config(None, SMALL_BATCH + args.overrides, run_dir=str(home / "run"), num_rollout=args.iterations)
    sampler = MemorySampler()
    sampler.start()
    state = sync_rl(config, return_state=True)
    sampler.stopped.set()
    assert state.is_completed(), state.message
    wait_for_task_history()  # as at exit: the database and the UI below then hold the whole run

    window = args.window
    ends = [record["finished_at"] for record in RunDir(config.run_dir).metrics()]
    first = (ends[window] - ends[0]) / window
    last = (ends[-1] - ends[-window - 1]) / window
    rss_first = sampler.mean_between(ends[0], ends[window])
    rss_last = sampler.mean_between(ends[-window - 1], ends[-1])
    per_1000 = (rss_last - rss_first) / (len(ends) - window) * 1000
    database = home / "prefect" / "prefect.db"
    print(f"iterations {len(ends)} in one flow run, {config.samples_per_rollout} samples each")
    print(f"first {window}: {first:.4f} s/iteration, RSS {rss_first:.0f} MiB")
    print(f"last {window}:  {last:.4f} s/iteration, RSS {rss_last:.0f} MiB")
    print(f"SQLite database {database.stat().st_size / 2**20:.1f} MiB")
    if CHROMIUM.exists():
        seconds = ui_task_list_seconds(str(state.state_details.flow_run_id))
        print(f"UI: the flow run's page listed its task runs in {seconds:.1f} s")
    else:
        print(f"UI: not timed (no Chromium at {CHROMIUM})")
    print(f"rss_growth_mib_per_1000 {per_1000:.1f}")
    print(f"long_run_growth {last / first:.3f}")


if __name__ == "__main__":
    main()
