"""What an engine class must offer to be driven by the InferenceController and the weight transports."""

from __future__ import annotations

import inspect

from miles.engines.base import RolloutEngine
from miles.rollout.weight_transport import DiskPush, DistributedPush, ObjectStorePush, TensorPush

PUSHES = {"object_store": ObjectStorePush, "disk": DiskPush, "tensor": TensorPush, "distributed": DistributedPush}
# Each transport's engine calls, as its pushes make them: the load, and the end of a push stopped part way.
TRANSPORT_CALLS = {
    transport: [call for call in (push.method, push.close) if call is not None] for transport, push in PUSHES.items()
}
ENGINE_CALLS = [
    name
    for name, member in vars(RolloutEngine).items()
    if (callable(member) or isinstance(member, classmethod))
    and not name.startswith("_")
    and not any(member in calls for calls in TRANSPORT_CALLS.values())
]


def contract_violations(engine: type) -> list[str]:
    """Every way `engine` falls short of the RolloutEngine protocol; [] when it is whole. A transport's calls are owed
    for each transport the class declares, and only for those."""
    problems = []
    transports = getattr(engine, "weight_transports", ())
    if not transports or not set(transports) <= set(PUSHES):
        problems.append(f"weight_transports {transports!r}: one or more of {sorted(PUSHES)}")
    if not hasattr(engine, "distributed_load_format"):
        problems.append("no distributed_load_format")
    owed = ENGINE_CALLS + [call.__name__ for t in transports for call in TRANSPORT_CALLS.get(t, ())]
    for name in owed:
        expected = inspect.signature(getattr(RolloutEngine, name))
        offered = getattr(engine, name, None)
        if offered is None:
            problems.append(f"no {name}")
        elif not _takes(inspect.signature(offered), expected):
            problems.append(f"{name}{inspect.signature(offered)} does not take {name}{expected}")
    return problems


def _takes(offered: inspect.Signature, expected: inspect.Signature) -> bool:
    """`offered` takes the protocol's parameters, in its order, and nothing else without a default (Ray adds a
    tracing keyword to the methods of a class it has made an actor of)."""
    names = list(offered.parameters)
    extra = list(offered.parameters.values())[len(expected.parameters) :]
    return names[: len(expected.parameters)] == list(expected.parameters) and all(
        p.default is not inspect.Parameter.empty or p.kind is inspect.Parameter.VAR_KEYWORD for p in extra
    )
