"""Ray start/attach and actor placement for the engine and trainer actors."""

from __future__ import annotations

import os

import ray


def ensure_ray(address: str | None, actors: int) -> None:
    """Attach to `address`, or start a local Ray sized so that every actor of the run gets a CPU slot."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        ray.init(
            num_cpus=max(os.cpu_count() or 1, actors),
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )


def actor_options(device: str = "cpu") -> dict:
    # One logical CPU per actor: Ray schedules, torch.set_num_threads decides the real threads. A CUDA actor asks
    # for a sliver of a GPU, so that Ray exposes one to it and the engine and trainer can share it.
    options = {"num_cpus": 1, "max_concurrency": 1}
    if device.startswith("cuda"):
        options["num_gpus"] = 0.01
    return options
