"""Weight sync: one push of the trainer's full weights to one engine, through the disk vs over a gloo broadcast.

Both transports run in one process against the same actors, as a run wires them (`miles.run.RLRun._push_weights`):
the trainer group started by `start_trainer_group` (one worker, one torch thread) behind a `RestartableActor`, and
an `InferenceController` with one TorchEngine (one torch thread), on a model directory built here.

- disk (`rollout.weight_transport=disk`): the trainer writes a model directory under `<run_dir>/engine_weights/<v>`
  (`TrainActor.write_weights`: a safetensors file per bucket of `train.weight_bucket_mb` (--bucket-mb), the
  index, the config and the tokenizer), then the engine loads it (`DiskPush`: `read_safetensors` +
  `load_state_dict`). A push is both; the table also shows the two parts, each timed alone.
- distributed (`rollout.weight_transport=distributed`): one `DistributedTransport` for the whole run; a push
  (`controller.update_weights(transport.push(v))`) has the trainer's rank 0 broadcast each bucket over the
  weight-update group, tensor by tensor, while the TorchEngine receives each tensor straight into its parameter
  (an SGLang server would get flattened buckets), and the first rows of every tensor are checked against what was
  sent. The first push also makes the group (a TCP rendezvous, the gloo
  process group on both sides); it is shown apart and left out of the median.

One warm-up push of each transport (the distributed one is the group's first push), then --rounds rounds, each a
disk push then a distributed push; every push carries a new version, and the engine must report it afterwards.
The model is a randomly initialised Llama (--hidden, --layers, --vocab; untied embeddings; about 166M parameters,
634 MiB of fp32 weights by default) saved with the embedded tokenizer. s/push: median wall seconds of the timed
pushes as the driver sees them; MiB/s: the weights' bytes per wall second.

Prints, last, `weight_sync_speedup <median seconds per disk push / per distributed push>` (goal: >= 3).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import ray
import torch
from transformers.utils import logging as hf_logging

from benchmarks.random_llama import random_llama
from benchmarks.smoke import parse_args
from miles.cluster.actors import RestartableActor, ensure_ray
from miles.cluster.placement import ray_actors
from miles.config import load_config
from miles.rollout.inference_controller import InferenceController
from miles.rollout.weight_transport import DiskPush, DistributedTransport, TrainerWeights
from miles.state.run_dir import RunDir
from miles.train.actor import TrainActor
from miles.train.group import start_trainer_group


def _timed(action) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def _measure(model_dir: Path, run_dir: Path, args) -> tuple[dict[str, list[float]], float]:
    """Seconds of each push (and of the disk push's parts), by what was timed; and the bucket size in MiB."""
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            "rollout.engine=torch",
            "rollout.num_engines=1",
            "rollout.num_threads=1",
            "rollout.rollout_batch_size=8",
            "rollout.n_samples_per_prompt=4",
            "train.num_threads=1",
            "train.global_batch_size=16",
            "train.micro_batch_size=8",
            *([f"train.weight_bucket_mb={args.bucket_mb}"] if args.bucket_mb else []),
        ],
        run_dir=str(run_dir),
    )
    run = RunDir(config.run_dir).create()
    ensure_ray(None, actors=ray_actors(config, critic=False))
    trainer = RestartableActor("trainer", lambda: start_trainer_group(config, model_dir, None))
    controller = None
    version = 0  # each push carries a new one, as if the trainer had trained in between
    try:
        controller = InferenceController(str(model_dir), 0, config.rollout)
        transport = DistributedTransport(
            TrainerWeights(trainer, None, version=lambda: version, probe=lambda: trainer.call(TrainActor.weight_probe)),
            lambda: controller.engines,
            controller.ranks_per_engine,
            controller.engine_class.distributed_load_format,
            backend="gloo",
            timeout_s=600,
        )
        times: dict[str, list[float]] = {"disk": [], "write": [], "load": [], "distributed": [], "first": []}

        def landed() -> None:
            held = ray.get(controller.engines[0].weight_version.remote())
            if held != version:
                raise RuntimeError(f"the engine holds weights version {held} after the push of version {version}")

        def disk_push(record: bool) -> None:
            directory = run.engine_weights / str(version)
            write = _timed(lambda: trainer.call(TrainActor.write_weights, str(directory)))
            probe = trainer.call(TrainActor.weight_probe)
            load = _timed(lambda: controller.update_weights(DiskPush(directory, version, probe)))
            landed()
            if record:
                times["disk"].append(write + load)
                times["write"].append(write)
                times["load"].append(load)

        def distributed_push(key: str | None) -> None:
            seconds = _timed(lambda: controller.update_weights(transport.push(version)))
            landed()
            if key:
                times[key].append(seconds)

        version += 1
        disk_push(record=False)  # warm-up: the first file writes and reads, the page cache
        version += 1
        distributed_push("first")  # warm-up: the group's rendezvous and gloo's connections
        for _ in range(args.rounds):
            version += 1
            disk_push(record=True)
            version += 1
            distributed_push("distributed")
        return times, config.train.weight_bucket_mb
    finally:
        if controller is not None:
            controller.shutdown()
        trainer.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument(
        "--bucket-mb", type=float, default=None, help="train.weight_bucket_mb (unset: the config's default)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed pushes per transport, after one warm-up each")
    args = parse_args(parser, hidden=64, layers=1, vocab=256, rounds=1)
    hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="weight-sync-") as workdir:
        model_dir = Path(workdir) / "model"
        model = random_llama(model_dir, args.hidden, args.layers, args.vocab, 256)
        parameters = sum(p.numel() for p in model.parameters())
        mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
        del model
        try:
            times, bucket_mb = _measure(model_dir, Path(workdir) / "run", args)
        finally:
            ray.shutdown()

    median = {key: statistics.median(values) for key, values in times.items()}
    print(
        f"model: random Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}, untied embeddings: "
        f"{parameters / 1e6:.1f}M parameters, {mib:.0f} MiB fp32, in buckets of {bucket_mb:g} MiB"
    )
    print(
        f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, ray {ray.__version__}; "
        "one trainer worker and one TorchEngine, one torch thread each"
    )
    print(f"{'transport':<14}{'s/push':>9}{'MiB/s':>9}   pushes (s)")
    for key in ("disk", "distributed"):
        print(f"{key:<14}{median[key]:>9.3f}{mib / median[key]:>9.0f}   {', '.join(f'{t:.3f}' for t in times[key])}")
    print(f"{'  write':<14}{median['write']:>9.3f}{mib / median['write']:>9.0f}   (disk: the trainer writes the files)")
    print(f"{'  load':<14}{median['load']:>9.3f}{mib / median['load']:>9.0f}   (disk: the engine loads them)")
    print(f"first distributed push (joins the group): {times['first'][0]:.3f} s, not in the median")
    print(f"weight_sync_speedup {median['disk'] / median['distributed']:.2f}")


if __name__ == "__main__":
    main()
