"""Environments the model acts in over several turns: the protocol, and how a config names one.

An environment is made per sample from its data row, `Env(row)` (the row's `prompt` and `label`, and any other
column of the data set), in the spirit of Gymnasium:

- `reset()` gives the first observation: the prompt the episode starts from (a string, or chat messages).
- `step(model_turn)` takes the text of the model's turn and gives a `StepResult`: the environment's reply (text
  or chat messages), a reward contribution and whether the episode is done.
- `finish(reason)`, optional, is called once when the episode ends without failing, with why it ended (one of
  END_REASONS: `done`, or a limit the runner enforced), and may give a last reward contribution.

Each method may be `async` (a tool call, a sandbox, a remote service). The episode's reward is the sum of its
contributions. A method that raises or outlasts `rollout.env_step_timeout_s` ends the episode as `failed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from miles.registry import check_name, import_object

Observation = str | list[dict[str, str]]

# Why an episode ended: the environment said done; or the runner stopped it at a limit (the episode is then
# truncated): rollout.max_turns, rollout.max_episode_tokens, or a model turn cut at rollout.max_new_tokens.
END_REASONS = ("done", "max_turns", "max_episode_tokens", "max_new_tokens", "env_error", "env_timeout")


@dataclass(frozen=True)
class StepResult:
    observation: Observation | None = None  # the reply the model sees next; unused once done
    reward: float = 0.0
    done: bool = False


@runtime_checkable
class Environment(Protocol):
    def reset(self) -> Observation: ...

    def step(self, model_turn: str) -> StepResult: ...


def builtin_environments() -> dict[str, type]:
    from miles.envs.calculator import CalculatorEnv

    return {"calculator": CalculatorEnv}


def resolve_environment(name: str) -> type:
    """The built-in environment `name`, or the class at import path `pkg.mod:Class`."""
    builtins = builtin_environments()
    try:
        check_name(name, list(builtins))
    except ValueError as exc:
        raise ValueError(f"rollout.env: {exc}") from None
    env = builtins.get(name) or import_object("rollout.env", name)
    if not callable(env) or not all(callable(getattr(env, method, None)) for method in ("reset", "step")):
        raise ValueError(f"rollout.env: {name!r} is not a class with reset() and step(model_turn) methods")
    return env
