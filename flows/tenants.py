"""The tenants of a multi-LoRA run, from Prefect: `rl-tenant-submit` adds an adapter to a running (or stopped)
multi-LoRA run, `rl-tenant-withdraw` saves and retires one.

    prefect deployment run rl-tenant-submit/tiny --param adapter='{"name": "add-2", "data": {"task": "addition"}}'
    prefect deployment run rl-tenant-withdraw/tiny --param name=add-2 --param reason="enough"

Each deployment's `run_dir` parameter names the multi-LoRA run it serves. A submission is checked as a configured
adapter is at a start (its data, reward and prompts; a free name; miles.multi_lora.admin.check_tenant) and as a run of the
deployment is (the allowed modules, roots and Ray addresses: flows.runtime.check_deployment_run), and fails with why;
an accepted one waits in the run directory, and the run admits it at its next iteration boundary.
"""

from __future__ import annotations

from prefect import flow

from control.policy import check_deployment_run
from miles.config import AdapterConfig
from miles.multi_lora import admin


@flow(name="rl-tenant-submit")
def submit_tenant(run_dir: str, adapter: AdapterConfig) -> str:
    admin.submit_tenant(run_dir, adapter, allowed=check_deployment_run)
    return f"adapter {adapter.name} submitted to {run_dir}: it joins the run at its next iteration boundary"


@flow(name="rl-tenant-withdraw")
def withdraw_tenant(run_dir: str, name: str, reason: str = "") -> str:
    admin.withdraw_adapter(run_dir, name, reason)
    return f"adapter {name} of {run_dir} withdrawn: it is saved and retired at its next iteration boundary"
