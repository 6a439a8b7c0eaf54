"""The weight-update group: flattened buckets, the check of what an engine holds, and a TorchEngine receiving."""

from __future__ import annotations

import pytest
import ray
import torch

from miles.engines.torch_engine import TorchEngine
from miles.weights.group import FLATTENED, flatten, unflatten
from tests.helpers import perturbed_weights
from tests.helpers.weight_sender import Sender, bucket_specs, in_buckets, new_group


def test_a_flattened_bucket_of_mixed_dtypes_comes_back_bit_exact():
    tensors = {
        "odd_bf16": torch.randn(3, dtype=torch.bfloat16),  # 6 bytes: the next tensor starts unaligned
        "matrix": torch.randn(2, 5),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "half": torch.randn(1, 3, dtype=torch.float16),
    }
    flat = flatten(list(tensors.values()))
    assert flat.dtype == torch.uint8 and flat.numel() == 6 + 40 + 8 + 6
    specs = [(name, str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()]
    back = unflatten(flat, specs)
    for name, tensor in tensors.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor)
    with pytest.raises(ValueError, match="60 bytes does not hold its 3 tensors"):
        unflatten(flat, specs[:3])


def test_a_torch_engine_receives_a_broadcast_joins_once_and_moves_to_a_new_group(ray_session, tiny_model_dir):
    engine = ray.remote(TorchEngine).options(num_cpus=1).remote(str(tiny_model_dir), num_threads=1)
    first, second = perturbed_weights(tiny_model_dir, 1, 0.05), perturbed_weights(tiny_model_dir, 2, 0.05)
    group = new_group()
    sender = Sender(group)
    try:
        # The second push reuses the group; tensor by tensor (into the parameters), then flattened.
        for version, weights, load_format in ((1, first, None), (2, second, FLATTENED)):
            buckets = in_buckets(weights, 3)
            sender.send(buckets, load_format)
            ray.get(
                engine.update_weights_from_distributed.remote(group, 1, bucket_specs(buckets), version, load_format)
            )
            sender.wait()
            assert ray.get(engine.weight_version.remote()) == version
        state = ray.get(engine.__ray_call__.remote(lambda self: self.model.state_dict()))
        assert all(torch.equal(state[name], second[name]) for name in second)
    finally:
        sender.close()

    moved = new_group()  # a restarted peer: the engine leaves the old group and joins the new one
    sender = Sender(moved)
    try:
        buckets = in_buckets(first, 1)
        sender.send(buckets, None)
        ray.get(engine.update_weights_from_distributed.remote(moved, 1, bucket_specs(buckets), 3, None))
        sender.wait()
        state = ray.get(engine.__ray_call__.remote(lambda self: self.model.state_dict()))
        assert all(torch.equal(state[name], first[name]) for name in first)
    finally:
        sender.close()
        ray.kill(engine)


def test_the_rendezvous_listens_on_its_host_alone():
    """torch's tcp:// store listens on every interface; ours on the address the group is given."""
    import os
    import socket
    from datetime import timedelta

    import psutil

    from miles.weights.group import rendezvous_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    store = rendezvous_store("127.0.0.1", port, 0, 1, timedelta(seconds=10))
    store.set("k", "v")
    listening = [
        c.laddr
        for c in psutil.Process(os.getpid()).net_connections("tcp")
        if c.status == "LISTEN" and c.laddr.port == port
    ]
    assert listening and all(address.ip == "127.0.0.1" for address in listening)
