"""Pause, steer, resume and cancel a running RL flow at an iteration boundary, on Prefect's own states.

Asking (any of these, at any time; the iteration in flight finishes first, the async graphs drain what is in flight):
- `miles pause FLOW_RUN_ID [--release]` (a Running state named Pausing, or Pausing to release), or an automation
  that sets one of those (control/automations.py): pause, without the flow run's tasks ever waiting;
- a Paused state set through the API or by an automation's change-state action: pause;
- the UI's Cancel, `prefect flow-run cancel`, `miles cancel` (a Running state named Stopping): cancel.
The UI's Pause on a deployment's flow run is Prefect's own suspend (a Suspended state), left to Prefect: the flow
process exits before its next task, releasing everything, and the UI's Resume runs the deployment's flow again, which
resumes from the run directory after its last trained rollout.

A watcher thread reads the flow run's state every MILES_CONTROL_POLL_S seconds (2); a Paused or Cancelling state it finds is turned back
into Running at once (named Pausing or Stopping, with the reason), so that the iteration in flight runs on
instead of waiting; its message says that the run has taken the request. At the boundary the run saves its checkpoint, then:
- pause: the flow run pauses with `pause_flow_run` and a typed form (MidRunSettings, prefilled with the values in
  effect); the engines and the trainer are released meanwhile when asked (--release), held otherwise.
  Resume in the UI (its form) or with `miles resume FLOW_RUN_ID --set lr=...`: what differs is applied from the next
  rollout on and recorded in run.json, the next iteration's metrics line and the `<flow>-config-changes` artifact;
- cancel: the flow run ends Cancelled; the run directory resumes with `miles run` as any other.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

import pydantic
from prefect.artifacts import create_table_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import State
from prefect.context import FlowRunContext
from prefect.flow_runs import pause_flow_run, resume_flow_run
from prefect.input import RunInput
from prefect.states import Cancelled, Running

from miles.config import MID_RUN_FIELDS, ConfigError, MidRunSettings, field_value
from miles.schedules import Steps

log = logging.getLogger(__name__)

POLL_VARIABLE = "MILES_CONTROL_POLL_S"
# How often the flow reads its flow run's state for a request: one API read, off the iterations' path.
DEFAULT_POLL_S = 2.0
PAUSE_TIMEOUT_VARIABLE = "MILES_PAUSE_TIMEOUT_S"
# How long a paused run waits for its resume before the flow run fails (its run directory resumes all the same).
DEFAULT_PAUSE_TIMEOUT_S = 7 * 24 * 3600

PAUSING, RELEASING, STOPPING = "Pausing", "Pausing to release", "Stopping"


def pause_timeout_s() -> int:
    return int(os.environ.get(PAUSE_TIMEOUT_VARIABLE, DEFAULT_PAUSE_TIMEOUT_S))


@dataclass(frozen=True)
class Request:
    action: Literal["pause", "cancel"]
    release: bool
    reason: str
    asked_at: datetime | None = None


def request_of(state: State) -> Request | None:
    """What a state of a running flow run asks of it: a pause (releasing or holding), a cancel, or nothing. The
    pause the run makes itself (a Paused state with a pause key) asks nothing, nor does Prefect's own suspend."""
    details = state.state_details
    if state.is_paused() and not details.pause_key and not details.pause_reschedule:
        return Request("pause", False, state.message or "", state.timestamp)
    if state.is_cancelling():
        return Request("cancel", False, state.message or "", state.timestamp)
    if state.is_running() and state.name in (PAUSING, RELEASING, STOPPING):
        action = "cancel" if state.name == STOPPING else "pause"
        return Request(action, state.name == RELEASING, state.message or "", state.timestamp)
    return None


def asking_state(request: Request) -> State:
    """The Running state that carries `request` until the boundary."""
    name = STOPPING if request.action == "cancel" else RELEASING if request.release else PAUSING
    what = "cancels" if request.action == "cancel" else "pauses"
    return Running(
        name=name, message=f"{what} at the next iteration boundary" + (f": {request.reason}" * bool(request.reason))
    )


def _says(state: State, taken: State) -> bool:
    """`state` is the one that says the run has taken its request."""
    return (state.name, state.message) == (taken.name, taken.message)


class FlowRunControl:
    """The Control (miles.schedules) of the flow run it is made in: `steps(STEPS)` gives the flow's steps with it."""

    def __init__(self):
        context = FlowRunContext.get()
        self.flow_run_id = context.flow_run.id
        self.flow_name = context.flow.name
        self.poll_s = float(os.environ.get(POLL_VARIABLE, DEFAULT_POLL_S))
        self.cancelled = False
        self.pauses = 0
        self._request: Request | None = None
        self._handled_until: datetime | None = None  # requests made before this are done
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="flow-run-control", daemon=True)

    def __enter__(self) -> FlowRunControl:
        self._watcher.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._watcher.join()

    def steps(self, steps: Steps) -> Steps:
        return replace(steps, control=self)

    def _watch(self) -> None:
        with get_client(sync_client=True) as client:
            while not self._stop.wait(self.poll_s):
                try:
                    state = client.read_flow_run(self.flow_run_id).state
                except Exception as exc:  # noqa: BLE001 - an API that does not answer now may answer at the next poll
                    log.debug("reading the flow run's state failed: %s", exc)
                    continue
                request = request_of(state) if state is not None else None
                with self._lock:
                    if request is None:
                        continue
                    held = self._request
                    if held is None:
                        if self._handled_until is not None and request.asked_at <= self._handled_until:
                            continue
                        self._request = request
                    elif _says(state, asking_state(held)):
                        continue
                    elif request.action == "cancel":
                        # Asked again while a request is held (an automation that fires twice, a cancel after a
                        # pause): a cancel wins over a pause, and the state says again that the run has taken it.
                        self._request = replace(request, asked_at=held.asked_at)
                    taken = asking_state(self._request)
                    newly_asked = held is None or held.action != self._request.action
                    action = self._request.action
                # Running (the tasks of the iteration in flight would wait, paused, or fail, cancelling), and the
                # message says the run has taken the request.
                client.set_flow_run_state(self.flow_run_id, taken, force=True)
                if newly_asked:
                    log.warning("%s asked: %s at the next iteration boundary", self.flow_name, action)

    def requested(self) -> Literal["pause", "cancel"] | None:
        with self._lock:
            return self._request.action if self._request else None

    def pause(self, run: Any, next_rollout_id: int) -> None:
        request = self._request
        if request.release:
            run.release()
        description = _pause_description(run, next_rollout_id, request)
        restarted = False
        while True:
            self.pauses += 1
            form = _steer_form(MidRunSettings.of(run.config, next_rollout_id), description)
            answer = pause_flow_run(
                wait_for_input=form,
                timeout=pause_timeout_s(),
                poll_interval=max(1, int(self.poll_s)),
                key=f"boundary-{next_rollout_id}-{self.pauses}",
            )
            settings = MidRunSettings.model_validate(answer.model_dump(include=set(MidRunSettings.model_fields)))
            if request.release and not restarted:
                run.start_again()
                restarted = True
            try:
                change = settings.change(run.config, next_rollout_id)
                if change is not None:
                    run.change_config(change)
            except ConfigError as exc:  # shown in the form of the next pause; nothing changed
                description = f"**Not applied:** {exc}\n\n{description}"
                continue
            break
        self._done(request)
        if change is not None:
            log.warning("from rollout %d on: %s (by %s)", next_rollout_id, change.values, change.by or "unnamed")
            _changes_artifact(run, self.flow_name)

    def hold(self, run: Any) -> None:
        """The multi-LoRA run's pause: no form (each adapter's settings are its tenant's), resumed as it is."""
        request = self._request
        if request.release:
            run.release()
        self.pauses += 1
        pause_flow_run(
            timeout=pause_timeout_s(), poll_interval=max(1, int(self.poll_s)), key=f"boundary-hold-{self.pauses}"
        )
        if request.release:
            run.start_again()
        self._done(request)

    def _done(self, request: Request) -> None:
        """The request is done: the watcher takes only those made after now."""
        with self._lock:
            self._request, self._handled_until = None, datetime.now(tz=request.asked_at.tzinfo)

    def end(self, summary: dict[str, Any]) -> dict[str, Any] | State:
        """The flow's result: its summary, or a Cancelled state carrying it when the run was cancelled."""
        if self._request is not None and self._request.action == "cancel":
            reason = f" ({self._request.reason})" if self._request.reason else ""
            return Cancelled(
                message=f"cancelled at an iteration boundary{reason}; the run directory resumes", data=summary
            )
        return summary


def _steer_form(current: MidRunSettings, description: str) -> type[RunInput]:
    """The pause form: every MidRunSettings field, prefilled with the value in effect."""
    fields = {
        name: (info.annotation, pydantic.fields.FieldInfo.merge_field_infos(info, default=getattr(current, name)))
        for name, info in MidRunSettings.model_fields.items()
    }
    form = pydantic.create_model("ChangeRunSettings", __base__=RunInput, **fields)
    form._description = description
    return form


def _pause_description(run: Any, next_rollout_id: int, request: Request) -> str:
    held = "released (they start again at the resume)" if request.release else "held"
    why = f" Asked: {request.reason}." if request.reason else ""
    return (
        f"Paused before rollout {next_rollout_id} of {run.config.final.num_rollout}; checkpoint saved in "
        f"`{run.run_dir.path}`. Engines and trainer: {held}.{why}\n\n"
        "Change any value below: it applies from rollout "
        f"{next_rollout_id} on, and is recorded with your name and reason in run.json, metrics.jsonl and the "
        "config-changes artifact."
    )


def _changes_artifact(run: Any, flow_name: str) -> None:
    rows = []
    for change in run.config.changes:
        for field, value in change.values.items():
            before = run.config.at(change.rollout_id - 1) if change.rollout_id else None
            rows.append(
                {
                    "rollout_id": change.rollout_id,
                    "field": field,
                    "from": field_value(before, field) if before is not None else None,
                    "to": value,
                    "by": change.by,
                    "reason": change.reason,
                }
            )
    create_table_artifact(
        key=f"{flow_name}-config-changes", table=rows, description=f"config changes of {run.config.run_dir}"
    )


class Approval(RunInput):
    """The rl-pipeline's approval form: the UI's Resume form and `miles approve` answer it alike."""

    approve: bool = pydantic.Field(False, description="promote this checkpoint")
    changed_by: str = pydantic.Field("", description="who decides (recorded)")
    reason: str = pydantic.Field("", description="why (recorded; a rejection's reason is what the run's owner reads)")


# Asking from outside the flow run (the `miles` CLI).


def ask_pause(flow_run_id: UUID, release: bool = False, reason: str = "") -> None:
    request = Request("pause", release, reason)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, asking_state(request), force=True)


def ask_cancel(flow_run_id: UUID, reason: str = "") -> None:
    request = Request("cancel", False, reason)
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, asking_state(request), force=True)


def resume(flow_run_id: UUID, values: dict[str, Any], by: str = "", reason: str = "") -> None:
    """Resume a paused run with the form's fields in `values` (by their name in the form, MID_RUN_FIELDS); the others
    keep the values in effect."""
    unknown = sorted(set(values) - set(MID_RUN_FIELDS))
    if unknown:
        raise ConfigError(f"{', '.join(unknown)}: not a value a run may change; these are: {', '.join(MID_RUN_FIELDS)}")
    if values:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(flow_run_id).state
        if state is not None and state.is_paused() and not state.state_details.run_input_keyset:
            raise ConfigError(
                f"flow run {flow_run_id} is paused without a form (a multi-LoRA run): it takes no changes"
            )
    resume_flow_run(flow_run_id, run_input={**values, "changed_by": by, "reason": reason})


def answer_approval(flow_run_id: UUID, approve: bool, by: str = "", reason: str = "") -> None:
    """Answer a paused rl-pipeline's approval form, as its Resume form in the UI does."""
    resume_flow_run(flow_run_id, run_input=Approval(approve=approve, changed_by=by, reason=reason).model_dump())
