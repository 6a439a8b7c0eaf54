"""Reward functions, by import path, that fail on chosen labels: each label names how it fails."""

from __future__ import annotations

from miles.rewards import digit_match

BAD_RETURNS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "none": None, "text": "1.0"}


def fails_on_some_labels(response: str, label: str, finished: bool):
    if label == "raise":
        raise RuntimeError(f"cannot score {response!r}")
    if label in BAD_RETURNS:
        return BAD_RETURNS[label]
    return digit_match(response, label, finished)


def always_raises(response: str, label: str, finished: bool) -> float:
    raise KeyError(label)


def interrupted(response: str, label: str, finished: bool) -> float:
    raise KeyboardInterrupt


def constant_unless_differ(response: str, label: str, finished: bool) -> float:
    """1 on every sample of a prompt labelled "same" (a group without reward spread); the response read as a number
    on any other."""
    return 1.0 if label == "same" else float(response)


def echo_generate(client, samples):
    """A generate function (rollout.generate_fn) that needs no engine: the response is the prompt's characters'
    ids, the second half masked out, rewarded by its length."""
    from miles.rollout.generation import SampleRecord

    records = []
    for sample in samples:
        ids = [ord(ch) for ch in sample.row["prompt"]]
        half = len(ids) // 2
        records.append(
            SampleRecord(
                prompt=sample.row["prompt"],
                prompt_ids=[1],
                response_ids=ids,
                rollout_logprobs=[-1.0] * half + [0.0] * (len(ids) - half),
                loss_mask=[1] * half + [0] * (len(ids) - half),
                reward=float(len(ids) + sample.seed % 2),
                status="completed",
                weight_version=3,
                num_turns=2,
                end_reason="done",
            )
        )
    return records


def too_few_records(client, samples):
    return echo_generate(client, samples)[:-1]
