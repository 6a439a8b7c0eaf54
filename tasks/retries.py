"""The retry policy of every task, in one place: transient failures are retried, bad input is not.

A ValueError, TypeError or KeyError (a ConfigError is a ValueError) says the config or the data is wrong; a
retry would fail the same way, so the task fails at once with that message. Anything else is retried after 1 s,
then 4 s, then 10 s, each stretched by up to 50% jitter: an engine that died or hung (EngineRestarted: the
controller has already restarted it with the current weights), a trainer that died (ActorLost: the retry
restores it from the latest checkpoint and the ledger), an SGLang server that failed once but passes its
health check (EngineUnavailable), a lost connection. A refused SGLang request (4xx) is a ValueError. The
retries show in the task run's state history in the UI.
"""

from __future__ import annotations

NOT_RETRIED = (ValueError, TypeError, KeyError)
RETRY_DELAYS_S = (1, 4, 10)


def _is_transient(task, task_run, state) -> bool:
    try:
        state.result()
    except NOT_RETRIED:  # ray re-raises an actor's ValueError as a subclass of ValueError too
        return False
    except Exception:
        return True
    return False


def retry_policy(retries: int) -> dict:
    """Keyword arguments for `@task`: `retries` attempts after the first, for transient failures only."""
    return {
        "retries": retries,
        "retry_delay_seconds": list(RETRY_DELAYS_S[:retries]),
        "retry_jitter_factor": 0.5,
        "retry_condition_fn": _is_transient,
    }
