"""Real faults for recovery tests: an actor's process is frozen with a call in flight, then killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pyarrow as pa
import ray


def actor_pid(handle) -> int:
    return ray.get(handle.__ray_call__.remote(lambda self: os.getpid()))


def sglang_server_pid(handle) -> int:
    """The pid of the server an SGLangEngine actor started (its own process group)."""
    return ray.get(handle.__ray_call__.remote(lambda self: self._process.pid))


def freeze_then_kill(handle, after_s: float = 1.0) -> int:
    """SIGSTOP the actor's process now and SIGKILL it `after_s` later: a call made meanwhile is in flight when it dies."""
    pid = actor_pid(handle)
    os.kill(pid, signal.SIGSTOP)
    threading.Timer(after_s, os.kill, (pid, signal.SIGKILL)).start()
    return pid


def fault_before(monkeypatch, cls, method: str, when, fault) -> list:
    """Patch `cls.method(self, rollout_id, ...)` to run `fault(self)` first, once, on the first call where
    `when(self, rollout_id)` holds. Returns the list that records (rollout_id, pid) of the fault."""
    real = getattr(cls, method)
    fired: list = []

    def with_fault(self, rollout_id, *args):
        if not fired and when(self, rollout_id):
            fired.append((rollout_id, fault(self)))
        return real(self, rollout_id, *args)

    monkeypatch.setattr(cls, method, with_fault)
    return fired


def assert_whole_rollouts(run_dir, rollout_ids, samples: int) -> None:
    """Every rollout file is complete (its Arrow footer reads, all samples there) and no temp file is left."""
    root = Path(run_dir) / "rollouts"
    assert sorted(p.name for p in root.iterdir()) == sorted(f"rollout_{i}.arrow" for i in rollout_ids)
    for i in rollout_ids:
        with pa.memory_map(str(root / f"rollout_{i}.arrow")) as source:
            assert pa.ipc.open_file(source).read_all().num_rows == samples


def assert_same_samples(run_dir, reference_dir, rollout_ids) -> None:
    """Every rollout holds the same sampled tokens as the reference run's: a recovery regenerates what was lost
    from the same seeds. (Their log-probs may differ at float rounding: the engines batch whatever is in flight.)"""
    for i in rollout_ids:
        tables = [
            pa.ipc.open_file(str(Path(d) / "rollouts" / f"rollout_{i}.arrow")).read_all()
            for d in (run_dir, reference_dir)
        ]
        assert tables[0].column("response_ids").equals(tables[1].column("response_ids")), f"rollout {i}"
