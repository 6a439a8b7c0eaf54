"""Per-rank pushes: the tensor transport with each trainer rank sending to the engine on its own GPU, vs rank 0
sending to every engine.

Two trainer ranks (FSDP2 over gloo) colocated with two SGLang engines (the stand-in server, which loads
`/update_weights_from_tensor` payloads as SGLang does) on a Ray node of two simulated GPUs (miles.cluster.placement: Ray's
GPU accounting real, torch on the CPU, where a payload carries the bytes rather than CUDA IPC handles). The same
controller and trainer group push the same weights both ways, alternately, each push a new version checked on both
engines (miles.weights.check):

- per rank (`TrainerWeights.senders=2`, what a colocated run does): every rank gathers each bucket (FSDP's
  all-gather) and serializes it for its own engine;
- rank 0 alone (`senders=1`): rank 0 serializes each bucket and both engines load rank 0's payloads (on a GPU,
  engine 1 could not even map them: they are handles to rank 0's device).

Bytes from rank 0: the payload bytes rank 0 produces, times the engines that load them. s/push: median wall seconds
per push as the driver sees it. The model is a randomly initialised Llama (--hidden, --layers, --vocab).

Prints `per_rank_push_rank0_bytes_ratio` (goal: <= 0.6), then last `per_rank_push_time_ratio <median per-rank push
/ median rank-0 push>` (goal: <= 0.7).
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
from miles.cluster.placement import ColocatedBundles, simulated_cluster
from miles.config import load_config
from miles.rollout.inference_controller import InferenceController
from miles.rollout.weight_transport import TensorPush, TrainerWeights
from miles.state.run_dir import RunDir
from miles.train.actor import TrainActor
from miles.train.group import start_trainer_group
from tests.helpers import SGLANG_STAND_IN

PAIRS = 2


class CountedPush(TensorPush):
    """A tensor push that keeps each round's refs to rank 0's payloads and the engines they go to, for the bytes
    rank 0 sent to be counted once the push is timed."""

    def __init__(self, source: TrainerWeights, version: int):
        super().__init__(source, version)
        self.from_rank0: list[tuple[ray.ObjectRef, int]] = []

    def rounds(self, engines):
        for calls in super().rounds(engines):
            rank0 = calls[0][0]
            self.from_rank0.append((rank0, sum(args[0] == rank0 for args in calls.values())))
            yield calls

    def rank0_bytes(self) -> int:
        return sum(engines * sum(len(p) for p in ray.get(ref)) for ref, engines in self.from_rank0)


def _measure(model_dir: Path, run_dir: Path, rounds: int) -> tuple[dict[str, list[float]], dict[str, int]]:
    config = load_config(
        None,
        [
            f"model.path={model_dir}",
            "rollout.engine=sglang",
            f"rollout.sglang.server_module={SGLANG_STAND_IN}",
            "rollout.sglang.mem_fraction_static=0.5",
            "rollout.device=cuda",
            "train.device=cuda",
            "rollout.colocate=true",
            f"rollout.num_engines={PAIRS}",
            f"train.num_workers={PAIRS}",
            "train.num_threads=1",
            "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=4",
            "train.global_batch_size=16",
            "train.micro_batch_size=8",
        ],
        run_dir=str(run_dir),
    )
    RunDir(config.run_dir).create()
    colocated = ColocatedBundles(PAIRS)
    trainer = RestartableActor("trainer", lambda: start_trainer_group(config, model_dir, None, colocated))
    controller = None
    version = 0
    try:
        controller = InferenceController(str(model_dir), 0, config.rollout, colocated=colocated)

        def weights(senders: int) -> TrainerWeights:
            probe = lambda: trainer.call(TrainActor.weight_probe, "float32")  # noqa: E731 - the served dtype here
            return TrainerWeights(trainer, "float32", version=lambda: version, probe=probe, senders=senders)

        ways = {"per rank": weights(PAIRS), "rank 0 alone": weights(1)}
        times: dict[str, list[float]] = {way: [] for way in ways}
        rank0_bytes: dict[str, int] = {}
        for round_index in range(rounds + 1):  # the first round warms up and is left out
            for way, source in ways.items():
                version += 1
                push = CountedPush(source, version)
                started = time.perf_counter()
                controller.update_weights(push)
                seconds = time.perf_counter() - started
                rank0_bytes[way] = push.rank0_bytes()
                if round_index:
                    times[way].append(seconds)
        return times, rank0_bytes
    finally:
        if controller is not None:
            controller.shutdown()
        trainer.kill()
        colocated.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3, help="timed pushes each way, after one warm-up round")
    args = parse_args(parser, hidden=64, layers=1, vocab=256, rounds=1)
    hf_logging.disable_progress_bar()

    with tempfile.TemporaryDirectory(prefix="per-rank-push-") as workdir:
        model_dir = Path(workdir) / "model"
        model = random_llama(model_dir, args.hidden, args.layers, args.vocab, 256)
        mib = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
        del model
        with simulated_cluster(nodes=1, gpus_per_node=PAIRS) as address:
            ensure_ray(address, actors=2 * PAIRS)
            try:
                times, rank0_bytes = _measure(model_dir, Path(workdir) / "run", args.rounds)
            finally:
                ray.shutdown()

    median = {way: statistics.median(values) for way, values in times.items()}
    print(
        f"model: random Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {mib:.0f} MiB fp32; "
        f"{PAIRS} trainer ranks (FSDP2, gloo) colocated with {PAIRS} SGLang stand-ins on simulated GPUs"
    )
    print(f"machine: {os.cpu_count()} CPUs, torch {torch.__version__}, ray {ray.__version__}")
    print(f"{'senders':<14}{'s/push':>9}{'MiB from rank 0':>17}   pushes (s)")
    for way in times:
        pushes = ", ".join(f"{t:.3f}" for t in times[way])
        print(f"{way:<14}{median[way]:>9.3f}{rank0_bytes[way] / 2**20:>17.1f}   {pushes}")
    print(f"per_rank_push_rank0_bytes_ratio {rank0_bytes['per rank'] / rank0_bytes['rank 0 alone']:.2f}")
    print(f"per_rank_push_time_ratio {median['per rank'] / median['rank 0 alone']:.2f}")


if __name__ == "__main__":
    main()
