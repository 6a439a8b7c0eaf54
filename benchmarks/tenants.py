"""Four tenants served by one running multi-LoRA run vs the same four adapters as four runs one after another.

Each adapter trains --steps rollouts of the embedded task (addition), --prompts prompts x --samples samples each.
Service side: a multi-LoRA run (the plain loop, in a thread) has started its engine and trainer group for a first
adapter of one rollout and waits for tenants (`tenants.idle_timeout_s`); the four are submitted to its run directory
(`miles.multi_lora.admin.submit_tenant`) at once, and the time runs from their submission until all four are done. The
other side runs `miles.loop.run_multi_lora` once per adapter, one after another, each starting its own engine and
trainer group (Ray is started once for both sides). One torch thread per engine and trainer worker.

Prints `tenants_wall_ratio <service wall seconds / sequential wall seconds>` (goal: <= 0.6).
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.smoke import UNTRAINED_MODEL, parse_args
from miles.cluster.actors import ensure_ray
from miles.config import AdapterConfig, DataConfig, load_config
from miles.loop import run_multi_lora
from miles.multi_lora.admin import adapter_states, submit_tenant

TENANTS = [f"tenant-{index}" for index in range(4)]


def _adapter(name: str, steps: int, args) -> AdapterConfig:
    return AdapterConfig(
        name=name,
        data=DataConfig(task="addition"),
        num_steps=steps,
        rollout_batch_size=args.prompts,
        n_samples_per_prompt=args.samples,
        eval={"datasets": []},
    )


def _config(run_dir: Path, adapters: list[AdapterConfig], args, *overrides: str):
    config = load_config(
        None, ["rollout.num_threads=1", "train.num_threads=1", *overrides, *args.overrides], run_dir=str(run_dir)
    )
    return config.model_copy(update={"adapters": adapters})


def _service(workdir: Path, args) -> float:
    run_dir = workdir / "service"
    config = _config(run_dir, [_adapter("host", 1, args)], args, "tenants.idle_timeout_s=5")
    service = threading.Thread(target=run_multi_lora, args=(config,))
    service.start()
    while not (run_dir / "adapters" / "host" / "checkpoints" / "0").is_dir():  # started, its first adapter done
        time.sleep(0.05)
    started = time.perf_counter()
    for name in TENANTS:
        submit_tenant(run_dir, _adapter(name, args.steps, args))
    while not all(row["state"] == "done" for row in adapter_states(run_dir) if row["name"] in TENANTS):
        time.sleep(0.05)
    seconds = time.perf_counter() - started
    service.join()
    return seconds


def _one_after_another(workdir: Path, args) -> float:
    started = time.perf_counter()
    for name in TENANTS:
        run_multi_lora(_config(workdir / name, [_adapter(name, args.steps, args)], args))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="rollouts per adapter")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout")
    parser.add_argument("--samples", type=int, default=8, help="samples per prompt")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(parser, steps=1, prompts=2, samples=2, overrides=UNTRAINED_MODEL)
    ensure_ray(None, 2)
    with tempfile.TemporaryDirectory(prefix="tenants-") as workdir:
        sequential = _one_after_another(Path(workdir), args)
        service = _service(Path(workdir), args)
    print(
        f"4 adapters of the embedded task, {args.steps} rollouts each of {args.prompts} prompts x {args.samples} "
        "samples; one engine, one trainer worker"
    )
    print(f"one after another, each its own run: {sequential:.1f} s")
    print(f"tenants of one running service:      {service:.1f} s")
    print(f"tenants_wall_ratio {service / sequential:.3f}")


if __name__ == "__main__":
    main()
