"""Weight transports: how a version of the trainer's full weights reaches the engines (`rollout.weight_transport`).

- `object_store`: rank 0's gathered tensors go through Ray's object store into each engine's process
  (`RolloutEngine.update_weights`).
- `disk`: the trainer writes a model directory under `<run_dir>/engine_weights/`, and every engine loads it
  (`update_weights_from_disk`; SGLang's `/update_weights_from_disk`); the directory must be on storage the engines
  see, as the run directory is.
- `tensor`: each trainer rank colocated with an engine hands every bucket to the engine on its own GPU as SGLang's
  `/update_weights_from_tensor` payload (rank 0 to every engine where they are not colocated), a bucket a round:
  CUDA IPC handles to its own GPU memory, which a server on the same GPU maps without a copy (the colocated
  placement, where `distributed` cannot work: NCCL refuses two ranks on one device); on a CPU, the bytes.
- `distributed`: the trainer's rank 0 broadcasts the weights bucket by bucket over a weight-update group with every
  engine (miles.weights.group; `update_weights_from_distributed`), each bucket as the engine class's
  `distributed_load_format` asks: flattened into one tensor (SGLang's `/update_weights_from_distributed`) or tensor
  by tensor straight into the parameters (TorchEngine); nothing is written, nothing is copied whole.

Which transports an engine takes is its class's `weight_transports` (miles.engines.weight_transport picks one). Each
transport is a class whose `push(version)` makes the push of the trainer's weights as `version`.

A push is a `WeightPush`: the engine method that loads it and its arguments per engine, what the sender does while
the engines receive, and its `probe`, the trainer's log-probs of a fixed sequence under the pushed weights, against
which the controller checks what every engine then serves (miles.weights.check). An engine restarted by the controller gets the
push's `refill`: the same files or tensors for object_store and disk, kept until the next version lands; for
distributed, which keeps no copy, the trainer's current weights broadcast to every engine over a new group.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from miles.cluster.actors import RestartableActor
from miles.engines.base import RolloutEngine
from miles.train.actor import TrainActor
from miles.weights.check import WeightProbe
from miles.weights.group import TensorSpec, WeightGroup


class WeightPush:
    """Full weights as `version`, on their way to the engines; `probe` checks them there (None: unchecked)."""

    method: Callable  # the RolloutEngine method that loads them
    # The RolloutEngine method that ends a push stopped between two rounds (None: every push is one round).
    close: Callable | None = None

    def __init__(self, version: int, probe: WeightProbe | None):
        self.version = version
        self.probe = probe

    def rounds(self, engines: Iterable[int]) -> Iterator[dict[int, tuple]]:
        """The calls of `method` that load the weights on `engines`, round by round: engine index -> its call's
        arguments. One round, unless the transport sends the weights part by part."""
        yield {i: self.engine_args(i) for i in engines}

    def engine_args(self, index: int) -> tuple:
        """The arguments of engine `index`'s call of `method`, for a push of one round."""
        raise NotImplementedError

    def send(self) -> None:
        """The sender's side, run while the engines' calls are in flight."""

    def check(self, results: dict[int, Any]) -> None:
        """Raise when the transport failed (results: engine index -> its method's answer)."""

    def refill(self, restarted: list[int], engine_count: int) -> tuple[WeightPush, list[int]]:
        """The push that gives `restarted` engines these weights, and the engines it goes to."""
        return self, restarted

    def landed(self) -> None:
        """Every engine holds this version: what an earlier version left behind can go."""


class ObjectStorePush(WeightPush):
    method = RolloutEngine.update_weights

    def __init__(self, weights: ray.ObjectRef, version: int, probe: WeightProbe | None):
        super().__init__(version, probe)
        self.weights = weights

    def engine_args(self, index: int) -> tuple:
        return self.weights, self.version


class DiskPush(WeightPush):
    method = RolloutEngine.update_weights_from_disk

    def __init__(self, directory: Path, version: int, probe: WeightProbe | None):
        super().__init__(version, probe)
        self.directory = directory

    def engine_args(self, index: int) -> tuple:
        return str(self.directory), self.version

    def landed(self) -> None:
        for older in self.directory.parent.iterdir():
            if older != self.directory:
                shutil.rmtree(older, ignore_errors=True)


@dataclass(frozen=True)
class TrainerWeights:
    """What a tensor or distributed push needs of the trainer: the actor, the dtype the engines serve (what is sent;
    None: the trainer's own), the version it holds and its probe of the weights it holds (miles.weights.check)."""

    trainer: RestartableActor
    dtype: str | None
    version: Callable[[], int]
    probe: Callable[[], WeightProbe | None]
    senders: int = 1  # ranks that send tensor payloads: each colocated rank to its own engine, else rank 0 to all


class ObjectStoreTransport:
    """Rank 0's gathered weights through Ray's object store, for each push."""

    def __init__(self, source: TrainerWeights):
        self.source = source

    def push(self, version: int) -> ObjectStorePush:
        probe = self.source.probe()
        weights = self.source.trainer.hand_over_each(TrainActor.weights)[0]  # rank 0's
        return ObjectStorePush(weights, version, probe)


class DiskTransport:
    """Each version written as a model directory `<directory>/<version>` before its push."""

    def __init__(self, source: TrainerWeights, directory: Path):
        self.source = source
        self.directory = directory

    def push(self, version: int) -> DiskPush:
        directory = self.directory / str(version)
        self.source.trainer.call(TrainActor.write_weights, str(directory), self.source.dtype)
        return DiskPush(directory, version, self.source.probe())


class TensorTransport:
    def __init__(self, source: TrainerWeights):
        self.source = source

    def push(self, version: int) -> TensorPush:
        return TensorPush(self.source, version)


class TensorPush(WeightPush):
    """Transport tensor: each bucket as SGLang's `/update_weights_from_tensor` payload, a round each; on the GPU CUDA
    IPC handles to the memory of the trainer rank on the engine's GPU, which the server maps (miles.weights.payload):
    engine i gets rank i's payloads when the engines are colocated with the ranks (`senders` ranks), rank 0's
    otherwise. The trainer gathers the next bucket only when the engines have loaded the last: one bucket is in
    flight, not a copy of the model."""

    method = RolloutEngine.update_weights_from_tensor
    close = RolloutEngine.close_weight_update

    def __init__(self, source: TrainerWeights, version: int):
        super().__init__(version, source.probe())
        self.source = source

    def rounds(self, engines: Iterable[int]) -> Iterator[dict[int, tuple]]:
        trainer, senders = self.source.trainer, self.source.senders
        buckets = trainer.call(TrainActor.begin_weight_payloads, self.source.dtype, senders)
        for bucket in range(buckets):
            payloads = trainer.hand_over_each(TrainActor.next_weight_payload)
            last = bucket == buckets - 1
            yield {i: (payloads[i if senders > 1 else 0], self.version, last) for i in engines}

    def refill(self, restarted: list[int], engine_count: int) -> tuple[WeightPush, list[int]]:
        """The handles of a landed push point to memory the trainer has let go: new ones, of its current weights."""
        return TensorPush(self.source, self.source.version()), restarted

    def landed(self) -> None:
        self.source.trainer.call(TrainActor.release_payload_weights)


class DistributedPush(WeightPush):
    method = RolloutEngine.update_weights_from_distributed

    def __init__(self, transport: DistributedTransport, version: int):
        super().__init__(version, transport.source.probe())
        self.transport = transport
        self.group, self.rank_offsets = transport.group()
        self.buckets = transport.bucket_specs()

    def engine_args(self, index: int) -> tuple:
        return self.group, self.rank_offsets[index], self.buckets, self.version, self.transport.load_format

    def send(self) -> None:
        load_format, source = self.transport.load_format, self.transport.source
        error = source.trainer.call(TrainActor.broadcast_weights, self.group, load_format, source.dtype)
        if error is not None:
            raise RuntimeError(f"the trainer could not send weights version {self.version}: {error}")

    def check(self, results: dict[int, Any]) -> None:
        self.transport.group_works(self.group)

    def refill(self, restarted: list[int], engine_count: int) -> tuple[WeightPush, list[int]]:
        """The group lost a member: all engines join a new one and get the trainer's current weights."""
        return DistributedPush(self.transport, self.transport.source.version()), list(range(engine_count))


class DistributedTransport:
    """The weight-update group of the trainer's rank 0 and the engines, made anew whenever its members change (a
    restarted engine or trainer group) or a push over it failed."""

    def __init__(
        self,
        source: TrainerWeights,
        engines: Callable[[], list[ray.actor.ActorHandle]],
        ranks_per_engine: int,
        load_format: str | None,
        backend: str,
        timeout_s: float,
    ):
        self.source = source
        self.engines = engines
        self.ranks_per_engine = ranks_per_engine
        self.load_format = load_format
        self.backend = backend
        self.timeout_s = timeout_s
        self._group: WeightGroup | None = None
        self._members: tuple | None = None
        self._working = False  # the last push over the group landed
        self._made = 0
        self._specs: tuple[Any, list[list[TensorSpec]]] | None = None

    def push(self, version: int) -> DistributedPush:
        return DistributedPush(self, version)

    def group(self) -> tuple[WeightGroup, list[int]]:
        engines = self.engines()
        members = (self.source.trainer.group, *(engine._actor_id for engine in engines))
        if self._group is None or members != self._members or not self._working:
            host, port = self.source.trainer.call(TrainActor.free_address)
            self._made += 1
            self._group = WeightGroup(
                master_address=host,
                master_port=port,
                world_size=1 + self.ranks_per_engine * len(engines),
                group_name=f"miles-weights-{self._made}",
                backend=self.backend,
                timeout_s=self.timeout_s,
            )
            self._members, self._working = members, False
        return self._group, [1 + self.ranks_per_engine * i for i in range(len(engines))]

    def group_works(self, group: WeightGroup) -> None:
        self._working = group is self._group

    def bucket_specs(self) -> list[list[TensorSpec]]:
        """The trainer's buckets; they change only with the trainer group (a new model, the same names)."""
        if self._specs is None or self._specs[0] is not self.source.trainer.group:
            self._specs = (
                self.source.trainer.group,
                self.source.trainer.call(TrainActor.weight_bucket_specs, self.source.dtype),
            )
        return self._specs[1]
