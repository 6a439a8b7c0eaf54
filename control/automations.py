"""The automations miles ships: pause a run at its next iteration boundary (holding its engines and trainer) on a
unhealthy iteration (a value not finite, a reward failing on many samples) or a collapsed reward (control/events.py emits both). `miles automations apply` creates them, or
updates those of the same name, on the API that PREFECT_API_URL names; they act where the triggers service runs
(`prefect server start`; the embedded API runs none)."""

from __future__ import annotations

from datetime import timedelta

from prefect.automations import Automation, ChangeFlowRunState, EventTrigger, Posture
from prefect.client.schemas.objects import StateType

from control.events import COLLAPSED, UNHEALTHY
from control.requests import PAUSING


def shipped_automations() -> list[Automation]:
    """Pause a run at its next iteration boundary, holding its engines and trainer, on either alert; the event's
    resource is the flow run, which the action pauses."""
    return [
        _pause_on(UNHEALTHY, "miles: pause a run with an unhealthy iteration", "an iteration was unhealthy"),
        _pause_on(COLLAPSED, "miles: pause a run whose reward collapsed", "the reward collapsed"),
    ]


def _pause_on(event: str, name: str, why: str) -> Automation:
    return Automation(
        name=name,
        description=f"{why}: pause the flow run at its next iteration boundary, so that someone can look and steer",
        trigger=EventTrigger(
            expect={event},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[ChangeFlowRunState(state=StateType.RUNNING, name=PAUSING, message=why, force=True)],
    )


def apply_automations() -> list[str]:
    """Create the shipped automations, or update those of the same name; their names."""
    names = []
    for automation in shipped_automations():
        try:
            automation.id = Automation.read(name=automation.name).id
        except ValueError:
            automation.create()
        else:
            automation.update()
        names.append(automation.name)
    return names
