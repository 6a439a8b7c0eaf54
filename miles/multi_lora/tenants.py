"""The tenants of a multi-LoRA run: adapters that join and leave while it runs, through its run directory.

<run_dir>/tenants/ holds, per adapter name:

    <name>.json            a submitted adapter (its AdapterConfig), written once: the name is then taken for good
    <name>.withdrawn.json  a withdrawal (when, why): the adapter is saved and retired at its next iteration boundary
    <name>.failed.json     a failure (what failed): its branch ended, it was retired, and a restart does not resume it

The run (miles.multi_lora.run.MultiLoRARun) admits a submitted adapter at its next iteration boundary and a restart finds
every one here; each resumes where its own run directory (<run_dir>/adapters/<name>/) says. The adapters of the
config can be withdrawn, and can fail, as submitted ones. Writers never rewrite a file: a submission is created
exclusively, so two submissions of one name cannot both be taken.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from miles.config import AdapterConfig, ConfigError
from miles.state.atomic import write_json_atomic
from miles.state.run_dir import RunDir

SUBMITTED, WITHDRAWN, FAILED = ".json", ".withdrawn.json", ".failed.json"


class TenantBook:
    def __init__(self, run_dir: RunDir):
        self.path = run_dir.path / "tenants"

    def submit(self, adapter: AdapterConfig) -> Path:
        """Record `adapter` as submitted; a name submitted before is refused (ConfigError)."""
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.path / f"{adapter.name}{SUBMITTED}"
        staging = self.path / f".{adapter.name}.{os.getpid()}.{time.monotonic_ns()}"
        write_json_atomic(staging, adapter.model_dump(mode="json"))
        try:
            os.link(staging, target)  # fails when the name exists: the first submission keeps it
        except FileExistsError:
            raise ConfigError(f"adapter name {adapter.name!r} is taken in {self.path.parent}") from None
        finally:
            staging.unlink()
        return target

    def submitted(self) -> list[AdapterConfig]:
        """The submitted adapters, in the order they were submitted."""
        if not self.path.is_dir():
            return []
        files = [p for p in self.path.glob(f"*{SUBMITTED}") if p.name.count(".") == 1]
        files.sort(key=lambda p: (p.stat().st_mtime_ns, p.name))
        return [AdapterConfig.model_validate_json(p.read_text()) for p in files]

    def withdraw(self, name: str, reason: str = "") -> None:
        self._mark(name, WITHDRAWN, {"time": time.time(), "reason": reason})

    def fail(self, name: str, error: str) -> None:
        self._mark(name, FAILED, {"time": time.time(), "error": error})

    def withdrawn(self) -> dict[str, dict[str, Any]]:
        return self._marked(WITHDRAWN)

    def failed(self) -> dict[str, dict[str, Any]]:
        return self._marked(FAILED)

    def _mark(self, name: str, suffix: str, record: dict[str, Any]) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        target = self.path / f"{name}{suffix}"
        if not target.exists():  # the first record stays
            write_json_atomic(target, record)

    def _marked(self, suffix: str) -> dict[str, dict[str, Any]]:
        if not self.path.is_dir():
            return {}
        return {p.name.removesuffix(suffix): json.loads(p.read_text()) for p in self.path.glob(f"*{suffix}")}
