"""Placement: which GPUs the trainer's ranks and the engines take, reserved through Ray and recorded from what Ray
assigned.

Two layouts, chosen by `rollout.colocate`:
- **apart** (the default): every trainer rank takes a whole GPU, every engine `ranks` whole GPUs of its own (its
  tensor-parallel size), so engines land on distinct GPUs. A one-GPU request for a fraction would let Ray stack every
  engine on the fullest GPU that still fits.
- **colocated**: engine i shares trainer rank i's GPU. Each pair is one bundle `{GPU: 1}` of one placement group,
  which both members take half of: Ray hands them the same device.

What Ray assigned (node, GPU ids, CUDA_VISIBLE_DEVICES, the device's UUID where CUDA runs) is read inside each actor
(`location_of`) and recorded in run.json at every start; the weight transport is checked against it
(`check_transport`).

GPUs are simulated in tests: with MILES_SIMULATED_GPUS=1, Ray's accounting of GPU resources is real (a CPU node
started with `num_gpus=8`) while `torch_device`, `device_uuids` and `gpu_memory_bytes`, the one place that calls CUDA,
give the CPU, a made-up UUID per (node, GPU id) and an H100's memory.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from miles.config import RolloutConfig, RunConfig, TrainConfig

SIMULATED_GPUS = "MILES_SIMULATED_GPUS"
SIMULATED_GPU_GIB = 80  # the memory of a simulated GPU: an H100's
COLOCATED_SHARE = 0.5  # of a pair's GPU, for each member: Ray's accounting only, memory is split by the config


def simulated_gpus() -> bool:
    return os.environ.get(SIMULATED_GPUS) == "1"


def torch_device(name: str) -> torch.device:
    """The torch device of a config's `device` (cpu, cuda, cuda:N); the CPU for CUDA when GPUs are simulated."""
    import torch

    if name.startswith("cuda") and simulated_gpus():
        return torch.device("cpu")
    return torch.device(name)


def on_gpus(device: str) -> bool:
    """Whether actors of `device` ask Ray for GPUs (also when they are simulated)."""
    return device.startswith("cuda")


@dataclass(frozen=True)
class Location:
    """Where one actor runs, as Ray assigned it."""

    node_id: str
    node_ip: str
    gpu_ids: tuple[str, ...] = ()  # Ray's ids of the GPUs it was given (its CUDA_VISIBLE_DEVICES)
    cuda_visible_devices: str | None = None
    device_uuids: tuple[str, ...] = ()  # what CUDA reports for those GPUs, where CUDA runs

    def shares_device(self, other: Location) -> bool:
        """Both hold one same GPU: the same node and a common GPU id (the same UUID, where known)."""
        if self.device_uuids and other.device_uuids:
            return bool(set(self.device_uuids) & set(other.device_uuids))
        return self.node_id == other.node_id and bool(set(self.gpu_ids) & set(other.gpu_ids))

    def describe(self) -> str:
        gpus = f"GPU {','.join(self.gpu_ids)}" if self.gpu_ids else "no GPU"
        return f"node {self.node_ip} ({self.node_id[:8]}), {gpus}"

    def record(self) -> dict[str, Any]:
        return asdict(self)


def device_uuids(gpu_ids: tuple[str, ...], node_id: str) -> tuple[str, ...]:
    """The UUIDs of the GPUs this process sees, as CUDA reports them; made up from the node and Ray's GPU ids when GPUs
    are simulated, none where no GPU is visible."""
    if simulated_gpus():
        return tuple(f"GPU-simulated-{node_id[:8]}-{gpu}" for gpu in gpu_ids)
    import torch

    if not gpu_ids or not torch.cuda.is_available():
        return ()
    return tuple(str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count()))


def gpu_memory_bytes() -> int:
    """The memory of the first GPU this process sees, as CUDA reports it."""
    if simulated_gpus():
        return SIMULATED_GPU_GIB * 2**30
    import torch

    return torch.cuda.get_device_properties(0).total_memory


def here() -> Location:
    """The Location of the calling process (an actor)."""
    import ray

    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    gpu_ids = tuple(str(gpu) for gpu in context.get_accelerator_ids().get("GPU", []))
    return Location(
        node_id=node_id,
        node_ip=ray.util.get_node_ip_address(),
        gpu_ids=gpu_ids,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        device_uuids=device_uuids(gpu_ids, node_id),
    )


def location_of(handle) -> Location:
    """Where the actor behind `handle` runs, read inside it."""
    import ray

    return ray.get(handle.__ray_call__.remote(lambda _actor: here()))


@dataclass
class PlacementRecord:
    """Where a run's actors landed at one start (run.json's `placement`), or would land (`miles plan`): each trainer
    group's ranks by group name (policy, critic, or a multi-LoRA trainer group) and the engines."""

    colocated: bool
    transport: str
    trainers: dict[str, list[Location]] = field(default_factory=dict)
    engines: list[Location] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        return {
            "colocated": self.colocated,
            "transport": self.transport,
            "trainers": {name: [rank.record() for rank in ranks] for name, ranks in self.trainers.items()},
            "engines": [location.record() for location in self.engines],
        }

    def table(self) -> str:
        """One line per actor: where it is, its GPUs and what CUDA_VISIBLE_DEVICES Ray gave it."""
        rows = [("actor", "node", "GPUs", "CUDA_VISIBLE_DEVICES")]
        for name, ranks in self.trainers.items():
            rows += [(f"{name} rank {i}", *_cells(rank)) for i, rank in enumerate(ranks)]
        rows += [(f"engine {i}", *_cells(engine)) for i, engine in enumerate(self.engines)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
        layout = "colocated: engine i on trainer rank i's GPU" if self.colocated else "engines on GPUs of their own"
        return "\n".join([*lines, f"{layout}; weights reach the engines by {self.transport}"])


def _cells(location: Location) -> tuple[str, str, str]:
    return location.node_ip, ",".join(location.gpu_ids) or "-", location.cuda_visible_devices or "-"


def check_colocation(rollout: RolloutConfig, train: TrainConfig, engine_ranks: int) -> None:
    """Refuse a `rollout.colocate` that cannot be placed, naming the fields."""
    if not rollout.colocate:
        return
    if not (on_gpus(rollout.device) and on_gpus(train.device)):
        raise ValueError(
            f"rollout.colocate=true pairs each engine with a trainer rank on one GPU: it needs rollout.device and "
            f"train.device on cuda (they are {rollout.device} and {train.device})"
        )
    if engine_ranks != 1:
        raise ValueError(
            f"rollout.colocate=true places each engine on its trainer rank's one GPU: an engine of {engine_ranks} GPUs "
            f"(rollout.sglang.tp_size) cannot be colocated; set rollout.colocate=false"
        )
    if rollout.num_engines != train.num_workers:
        raise ValueError(
            f"rollout.colocate=true pairs engine i with trainer rank i: rollout.num_engines={rollout.num_engines} "
            f"must equal train.num_workers={train.num_workers}"
        )


def choose_transport(rollout: RolloutConfig, train: TrainConfig, engine: type) -> str:
    """The weight transport of a run, from its placement: `tensor` (CUDA IPC) where each engine shares a trainer
    rank's GPU (colocated: rank i hands engine i its payloads); `distributed` (a broadcast from rank 0 over NCCL)
    where the engines have GPUs of their own; the engine's own choice where the engines are not on GPUs, or where
    the engine takes neither (colocated torch engines load from the object store). `rollout.weight_transport`
    overrides it, and an impossible one is refused before any work, naming the fields."""
    ranks = engine.ranks(rollout)
    check_colocation(rollout, train, ranks)
    takes = engine.weight_transports
    cuda = on_gpus(rollout.device) and on_gpus(train.device)
    if not cuda:
        default = takes[0]
    elif rollout.colocate:
        default = "tensor" if "tensor" in takes else next(t for t in takes if t != "distributed")
    else:
        default = "distributed" if "distributed" in takes else takes[0]
    transport = rollout.weight_transport or default
    if transport not in takes:
        raise ValueError(
            f"rollout.weight_transport={transport}: the {rollout.engine} engine ({engine.__name__}) takes "
            f"{' or '.join(takes)}"
        )
    where = f"rollout.device={rollout.device}, train.device={train.device}, rollout.colocate={rollout.colocate}"
    if cuda and transport == "tensor" and not rollout.colocate:
        raise ValueError(
            f"rollout.weight_transport=tensor hands each engine CUDA IPC handles to a trainer rank's memory, which only "
            f"an engine on that rank's GPU can map; with {where} the engines are on GPUs of their own: use {default}, "
            f"or colocate them"
        )
    if cuda and transport == "distributed" and rollout.colocate:
        raise ValueError(
            f"rollout.weight_transport=distributed: with {where}, engine 0 shares trainer rank 0's GPU, and NCCL "
            f"refuses a group with two ranks on one GPU; use {default}"
        )
    if transport == "tensor" and ranks != 1:
        raise ValueError(
            f"rollout.weight_transport=tensor sends one payload per bucket, for an engine of one GPU: "
            f"rollout.sglang.tp_size={ranks}; use disk or distributed"
        )
    return transport


def weight_transport(rollout, train) -> str:
    """The transport a run's weight pushes take, chosen by placement (choose_transport)."""
    from miles.engines import resolve_engine

    return choose_transport(rollout, train, resolve_engine(rollout.engine))


def check_transport(transport: str, trainer: list[Location], engines: list[Location], colocated: bool) -> None:
    """Refuse, at start, a transport that what Ray assigned cannot carry: `tensor` needs each engine on its sender's
    GPU (trainer rank i's when colocated, else rank 0's), `distributed` over NCCL no engine on rank 0's."""
    if not trainer[0].gpu_ids:
        return
    if transport == "tensor":
        senders = [trainer[i] if colocated else trainer[0] for i in range(len(engines))]
        apart = [
            i
            for i, (engine, sender) in enumerate(zip(engines, senders, strict=True))
            if not engine.shares_device(sender)
        ]
        if apart:
            i = apart[0]
            raise RuntimeError(
                f"weight transport tensor: engine {i} is on {engines[i].describe()}, but the trainer rank that sends "
                f"it payloads is on {senders[i].describe()}: CUDA IPC handles cannot be mapped on another GPU"
            )
    shared = [i for i, engine in enumerate(engines) if engine.shares_device(trainer[0])]
    if transport == "distributed" and shared:
        raise RuntimeError(
            f"weight transport distributed: engines {shared} share trainer rank 0's GPU ({trainer[0].describe()}), and "
            f"NCCL refuses a group with two ranks on one GPU"
        )


def engine_options(options: dict[str, Any], index: int, colocated: ColocatedBundles | None) -> dict[str, Any]:
    """Ray options of engine `index`: its own (`miles.cluster.actors.actor_options`: whole GPUs), or pair `index`'s bundle."""
    return {**options, **colocated.options(index)} if colocated is not None else options


class Seat:
    """A placeholder actor: it holds one actor's Ray resources while a plan reads where Ray put it."""

    def location(self) -> Location:
        return here()


def trainer_groups(config: RunConfig, critic: bool) -> dict[str, RunConfig]:
    """A run's trainer groups, by name, each as the config its workers start from: the policy's and, when the
    algorithm trains one (`critic`), the critic's; or the multi-LoRA flow's groups."""
    if config.adapters:
        return {name: config for name in sorted({adapter.trainer_group for adapter in config.adapters})}
    groups = {"policy": config}
    if critic:
        groups["critic"] = config.critic_view()
    return groups


def ray_actors(config: RunConfig, critic: bool) -> int:
    """The Ray actors a run starts: its engines, its trainer groups' workers, its judge's engines and reward model."""
    workers = sum(group.train.num_workers for group in trainer_groups(config, critic).values())
    judges = config.judge.num_engines if "judge" in config.rewards_used else 0
    reward_model = 1 if "reward_model" in config.rewards_used else 0
    return config.rollout.num_engines + workers + judges + reward_model


def gpus_asked(config: RunConfig, engine_ranks: int, groups: dict[str, RunConfig]) -> int:
    """Whole GPUs a run takes: its engines' and trainer groups', a colocated pair's counted once."""
    engines = config.rollout.num_engines * engine_ranks if on_gpus(config.rollout.device) else 0
    trainers = sum(view.train.num_workers for view in groups.values() if on_gpus(view.train.device))
    if config.rollout.colocate:
        trainers -= config.train.num_workers  # the policy's ranks share the engines' GPUs
    return engines + trainers


def plan_placement(config: RunConfig, critic: bool) -> PlacementRecord:
    """Where a run's trainer ranks and engines would land on the Ray cluster this process is attached to: seats take
    each actor's own resource requests, by the code that starts the engines and trainer groups, report where Ray put
    them, and are released. A request the cluster cannot meet is refused, naming it."""
    import ray

    from miles.cluster.actors import ENGINE_CONCURRENCY, actor_options
    from miles.engines import resolve_engine

    engine = resolve_engine(config.rollout.engine)
    transport = choose_transport(config.rollout, config.train, engine)
    groups = trainer_groups(config, critic)
    asked = gpus_asked(config, engine.ranks(config.rollout), groups)
    has = int(ray.cluster_resources().get("GPU", 0))
    if asked > has:
        raise ValueError(
            f"the run asks for {asked} GPUs ({config.rollout.num_engines} engines of {engine.ranks(config.rollout)}, "
            f"trainer groups {', '.join(f'{n}: {v.train.num_workers}' for n, v in groups.items())}, "
            f"rollout.colocate={config.rollout.colocate}); the Ray cluster has {has}"
        )
    seat = ray.remote(Seat)
    taken: list = []
    releases: list = []
    try:
        colocated = ColocatedBundles(config.train.num_workers) if config.rollout.colocate else None
        if colocated is not None:
            releases.append(colocated.release)
        own = actor_options(config.rollout.device, engine.ranks(config.rollout), ENGINE_CONCURRENCY)
        engines = [
            seat.options(**engine_options(own, i, colocated)).remote() for i in range(config.rollout.num_engines)
        ]
        taken += engines
        trainers = {}
        for name, view in groups.items():
            on_bundle, release = worker_placement(view, colocated if name == "policy" else None)
            if release is not None:
                releases.append(release)
            trainers[name] = [seat.options(**on_bundle(rank)).remote() for rank in range(view.train.num_workers)]
            taken += trainers[name]
        placed = {"engine": _locations(engines, f"engine of {own}")}
        placed.update({name: _locations(handles, f"{name} rank") for name, handles in trainers.items()})
    finally:
        for handle in taken:
            ray.kill(handle)
        for release in releases:
            release()
    record = PlacementRecord(
        colocated=config.rollout.colocate,
        transport=transport,
        trainers={name: placed[name] for name in trainers},
        engines=placed["engine"],
    )
    if record.trainers.get("policy"):
        check_transport(transport, record.trainers["policy"], record.engines, record.colocated)
    return record


def _locations(seats: list, what: str) -> list[Location]:
    """Where each seat landed, once Ray placed them all."""
    import ray

    refs = [seat.location.remote() for seat in seats]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ColocatedBundles.TIMEOUT_S)
    if len(ready) < len(refs):
        raise RuntimeError(
            f"Ray could not place every {what} in {ColocatedBundles.TIMEOUT_S:.0f} s; the cluster has "
            f"{ray.available_resources()} free of {ray.cluster_resources()}"
        )
    return ray.get(refs)


@contextmanager
def simulated_cluster(nodes: int, gpus_per_node: int, cpus_per_node: int = 16) -> Iterator[str]:
    """A Ray cluster of `nodes` nodes on this machine that declare `gpus_per_node` GPUs each, which do not exist: Ray's
    GPU accounting, placement groups and CUDA_VISIBLE_DEVICES are real, torch runs on the CPU (SIMULATED_GPUS, set
    before the nodes start so that their workers inherit it), and Ray's token authentication is off, as a cluster of
    one machine for one process needs. Yields its address."""
    from ray.cluster_utils import Cluster

    changes = {SIMULATED_GPUS: "1", "RAY_AUTH_MODE": "disabled"}  # a cluster of this machine alone, for this process
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus_per_node, "num_gpus": gpus_per_node})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=cpus_per_node, num_gpus=gpus_per_node)
        cluster.wait_for_nodes()
        yield cluster.address
    finally:
        cluster.shutdown()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class ColocatedBundles:
    """The placement group of a colocated run: one `{GPU: 1}` bundle per trainer-rank-and-engine pair, packed on as
    few nodes as possible. Held for the whole run, so that a restarted engine or trainer group lands on its pair's GPU
    again."""

    TIMEOUT_S = 120.0

    def __init__(self, pairs: int, cpus_per_pair: float = 2.0):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        bundle = {"CPU": cpus_per_pair, "GPU": 1.0}
        self.group = placement_group([bundle] * pairs, strategy="PACK")
        ready, _ = ray.wait([self.group.ready()], timeout=self.TIMEOUT_S)
        if not ready:
            remove_placement_group(self.group)
            raise RuntimeError(
                f"rollout.colocate=true: Ray could not place {pairs} pairs of a trainer rank and an engine, one GPU "
                f"each ({bundle}), in {self.TIMEOUT_S:.0f} s; the cluster has {ray.available_resources()} free"
            )

    def options(self, index: int) -> dict[str, Any]:
        """Ray options of pair `index`'s member: half its bundle's GPU and CPUs."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        return {"scheduling_strategy": strategy, "num_cpus": 1, "num_gpus": COLOCATED_SHARE}

    def release(self) -> None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(self.group)


PLACEMENT_TIMEOUT_S = 120.0
STRATEGIES = {"pack": "PACK", "spread": "SPREAD"}


def worker_bundle(config: RunConfig) -> dict[str, float]:
    """What one worker reserves: a CPU slot (torch.set_num_threads decides the real threads), and on CUDA a whole GPU
    (a colocated run's pairs share theirs: miles.cluster.placement.ColocatedBundles)."""
    bundle = {"CPU": 1.0}
    if on_gpus(config.train.device):
        bundle["GPU"] = 1.0
    return bundle


def worker_placement(
    config: RunConfig, colocated: ColocatedBundles | None = None
) -> tuple[Callable[[int], dict], Callable[[], None] | None]:
    """Each rank's Ray options, and what releases them: pair i's bundle of a colocated run for rank i (the run holds
    them), else a placement group of train.num_workers bundles for the group alone."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if colocated is not None:
        return colocated.options, None
    workers = config.train.num_workers
    bundle = worker_bundle(config)
    group = placement_group([bundle] * workers, strategy=STRATEGIES[config.train.placement])
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"train.num_workers={workers} ({config.train.placement}): Ray could not place {workers} workers of "
            f"{bundle} in {PLACEMENT_TIMEOUT_S:.0f} s; the cluster has {ray.available_resources()} free"
        )

    def on_bundle(index: int) -> dict:
        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        return {"scheduling_strategy": strategy, "num_cpus": bundle["CPU"], "num_gpus": bundle.get("GPU", 0)}

    return on_bundle, lambda: remove_placement_group(group)
