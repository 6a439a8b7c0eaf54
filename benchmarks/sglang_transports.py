"""One weight push of the same weights to a real SGLang server on this CPU by each transport it takes: disk (the
trainer writes a model directory, the server loads it), tensor (`/update_weights_from_tensor` payloads; on a CPU the
bytes, on a GPU CUDA IPC handles) and distributed (a gloo broadcast from this process as the trainer's rank 0), and
the refit pause each costs (from `/pause_generation` to `/continue_generation`: the time generation stands still).

Each push includes the sender's work (writing the files, serializing, broadcasting); the model is a random Llama,
the pushes alternate, `--repeats` of each after one warm-up, medians reported.
Last line: `fastest_push_vs_disk <the fastest transport's median push time / disk's>`.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.random_llama import random_llama
from benchmarks.sglang_servers import add_server_arguments, server_config
from benchmarks.smoke import parse_args
from miles.engines.sglang_engine import SGLangEngine
from miles.weights.group import FLATTENED, WeightGroup, join, leave, send_bucket, tensor_specs
from miles.weights.payload import serialize_bucket


def _buckets(weights: dict[str, torch.Tensor], bucket_bytes: int) -> list[dict[str, torch.Tensor]]:
    buckets: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        if buckets[-1] and size + tensor.numel() * tensor.element_size() > bucket_bytes:
            buckets.append({})
            size = 0
        buckets[-1][name] = tensor
        size += tensor.numel() * tensor.element_size()
    return buckets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--bucket-mb", type=float, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    add_server_arguments(parser)
    args = parse_args(parser, hidden=64, layers=1, repeats=1)
    server_name, config = server_config(args)

    with tempfile.TemporaryDirectory(prefix="sglang-transports-") as workdir:
        model_dir = Path(workdir) / "model"
        model = random_llama(model_dir, args.hidden, args.layers, args.vocab, 64)
        weights = {name: tensor.detach().clone().contiguous() for name, tensor in model.state_dict().items()}
        buckets = _buckets(weights, int(args.bucket_mb * 2**20))
        megabytes = sum(t.numel() * t.element_size() for t in weights.values()) / 2**20
        print(f"random Llama of {megabytes:.0f} MiB (fp32) in {len(buckets)} buckets; server: {server_name}")
        engine = SGLangEngine(str(model_dir), device="cpu", config=config, timeout_s=600)
        pauses: list[float] = []
        post = engine._post

        def timed_post(path, body=None, timeout=None):
            if path == "/pause_generation":
                pauses.append(time.perf_counter())
            answer = post(path, body, timeout)
            if path == "/continue_generation":
                pauses[-1] = time.perf_counter() - pauses[-1]
            return answer

        engine._post = timed_post
        version = 0
        pushed = Path(workdir) / "pushed"

        def disk() -> None:
            directory = pushed / str(version)
            model.config.save_pretrained(directory)
            for index, bucket in enumerate(buckets):
                save_file(bucket, directory / f"model-{index:05d}.safetensors")
            engine.update_weights_from_disk(str(directory), version)

        def tensor() -> None:
            engine.update_weights_from_tensor([serialize_bucket(bucket)[0] for bucket in buckets], version)

        def distributed() -> None:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            group = WeightGroup("127.0.0.1", port, 2, f"bench-{version}", "gloo", 600.0)
            failure: list[BaseException] = []

            def send() -> None:
                try:
                    process_group = join(group, rank=0)
                    for bucket in buckets:
                        send_bucket(process_group, list(bucket.values()), FLATTENED)
                    leave(process_group)
                except BaseException as exc:  # noqa: BLE001 - raised below
                    failure.append(exc)

            sender = threading.Thread(target=send)
            sender.start()
            engine.update_weights_from_distributed(group, 1, [tensor_specs(b) for b in buckets], version, FLATTENED)
            sender.join()
            if failure:
                raise failure[0]

        transports = {"disk": disk, "tensor": tensor, "distributed": distributed}
        times: dict[str, list[float]] = {name: [] for name in transports}
        paused: dict[str, list[float]] = {name: [] for name in transports}
        try:
            for round_index in range(args.repeats + 1):  # the first round warms up
                for name, push in transports.items():
                    version += 1
                    started = time.perf_counter()
                    push()
                    took = time.perf_counter() - started
                    if engine.weight_version() != version:
                        raise SystemExit(f"{name}: the server holds version {engine.weight_version()}, not {version}")
                    if round_index:
                        times[name].append(took)
                        paused[name].append(pauses[-1])
        finally:
            engine.shutdown()

    print(f"{'transport':<12}{'push (s)':>10}{'MiB/s':>9}{'refit pause (s)':>17}  runs (s)")
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, median in medians.items():
        runs = ", ".join(f"{t:.3f}" for t in times[name])
        print(f"{name:<12}{median:>10.3f}{megabytes / median:>9.0f}{statistics.median(paused[name]):>17.3f}  {runs}")
    fastest = min(medians, key=medians.get)
    for name in ("tensor", "distributed"):
        print(f"{name} vs disk: {medians[name] / medians['disk']:.2f}x the time")
    print(f"fastest: {fastest}")
    print(f"fastest_push_vs_disk {medians[fastest] / medians['disk']:.3f}")


if __name__ == "__main__":
    main()
