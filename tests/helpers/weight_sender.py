"""This test process as rank 0 of a weight-update group: it broadcasts buckets as the trainer's rank 0 does."""

from __future__ import annotations

import socket
import threading
import uuid

import torch

from miles.weights.group import WeightGroup, join, leave, send_bucket, tensor_specs


def new_group(world_size: int = 2) -> WeightGroup:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return WeightGroup("127.0.0.1", port, world_size, f"test-weights-{uuid.uuid4().hex[:8]}", "gloo", 60.0)


def in_buckets(weights: dict[str, torch.Tensor], count: int) -> list[dict[str, torch.Tensor]]:
    names = list(weights)
    size = -(-len(names) // count)
    return [{name: weights[name] for name in names[i : i + size]} for i in range(0, len(names), size)]


def bucket_specs(buckets: list[dict[str, torch.Tensor]]) -> list:
    return [tensor_specs(bucket) for bucket in buckets]


class Sender:
    """Joins `group` as rank 0 in a thread (the join blocks until the engines join too), then sends each push."""

    def __init__(self, group: WeightGroup):
        self.group = group
        self.process_group = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def send(self, buckets: list[dict[str, torch.Tensor]], load_format: str | None) -> Sender:
        def run():
            try:
                if self.process_group is None:
                    self.process_group = join(self.group, rank=0)
                for bucket in buckets:
                    send_bucket(self.process_group, list(bucket.values()), load_format)
            except BaseException as exc:  # noqa: BLE001 - read by the test
                self.error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def wait(self) -> None:
        self._thread.join(60)
        assert not self._thread.is_alive(), "the broadcast did not finish"
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        if self.process_group is not None:
            leave(self.process_group)
