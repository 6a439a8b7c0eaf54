"""Evaluation during training: each eval data set sampled on the engines that hold the current weights and scored
by its reward, giving the mean reward and pass@k of the data set.

pass@k is the unbiased estimator of Chen et al. 2021, "Evaluating Large Language Models Trained on Code" (eq. 1):
with n samples of a prompt of which c pass, pass@k = 1 - C(n-c, k) / C(n, k), averaged over the prompts; computed
as 1 - prod_{i=n-c+1..n} (1 - k/i), their numerically stable form. A sample passes when its reward is at least the
data set's `pass_threshold`; a sample whose reward failed (or whose episode failed) does not pass, and is left out of the mean reward.
k runs over 1, 2, 4, ... up to n, and n itself.

An evaluation never touches the training data cursor and draws its seeds from (run seed, data set, rollout_id), so
a retried one samples the same tokens.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any, NamedTuple

import numpy as np

from miles.config import EvalDatasetConfig, RunConfig
from miles.data import load_rows
from miles.engines.base import SamplingParams
from miles.rewards import RewardFn, resolve_reward
from miles.rollout.generation import GenerateClient, RolloutSample, SampleRecord, resolve_generate_fn
from miles.rollout.inference_controller import InferenceController
from miles.state.seeds import eval_seed

log = logging.getLogger(__name__)


class EvalSet(NamedTuple):
    """One eval data set's checked inputs: its config, its rows, its reward."""

    dataset: EvalDatasetConfig
    rows: list[dict]
    reward: RewardFn | object

    def evaluated_rows(self, seed: int) -> list[dict]:
        """The rows each evaluation uses: `max_prompts` of them (a sample by `seed` when the data set shuffles)."""
        limit = self.dataset.max_prompts
        if limit is None or len(self.rows) <= limit:
            return self.rows
        return random.Random(seed).sample(self.rows, limit) if self.dataset.shuffle else self.rows[:limit]


def load_eval_sets(config: RunConfig) -> list[EvalSet]:
    """Every eval data set in effect, loaded and its reward resolved; errors name the data set."""
    sets = []
    for index, dataset in enumerate(config.eval_datasets):
        try:
            rows, reward = load_rows(dataset), resolve_reward(dataset.reward, config)
        except ValueError as exc:
            raise ValueError(f"eval.datasets.{index} ({dataset.name}): {exc}") from None
        if not rows:
            raise ValueError(f"eval.datasets.{index} ({dataset.name}): {dataset.path or dataset.task} has no rows")
        sets.append(EvalSet(dataset, rows, reward))
    return sets


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, c of them passing, passes."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples per prompt: powers of two up to n, and n."""
    return sorted({2**j for j in range(n.bit_length()) if 2**j <= n} | {n})


def eval_metrics(rewards: list[float | None], n: int, pass_threshold: float) -> dict[str, float]:
    """Mean reward over the scored samples and pass@k over the prompts; `rewards` holds n samples per prompt in order
    (None: the reward failed)."""
    scored = [r for r in rewards if r is not None]
    passed = np.array([r is not None and r >= pass_threshold for r in rewards]).reshape(-1, n).sum(axis=1)
    metrics = {"reward_mean": float(np.mean(scored)) if scored else math.nan}
    for k in pass_ks(n):
        metrics[f"pass_at_{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in passed]))
    return metrics


class Evaluation:
    """A policy's eval data sets on the engines; `run(eval_set, rollout_id)` gives the record of one evaluation.
    Samples come from the run's generate function (single completions, or episodes with rollout.env), each data set
    through a client of its own (its prompt format and reward)."""

    def __init__(
        self,
        config: RunConfig,
        sets: list[EvalSet],
        controller: InferenceController,
        tokenizer,
        adapter: str | None = None,
    ):
        self.config = config
        self.sets = sets
        self.adapter = adapter
        self.generate_fn = resolve_generate_fn(config)
        self.clients = {
            s.dataset.name: GenerateClient(controller, tokenizer, config, s.reward, s.dataset) for s in sets
        }
        self.rows = {s.dataset.name: s.evaluated_rows(config.seed) for s in sets}

    def run(self, eval_set: EvalSet, rollout_id: int) -> dict[str, Any]:
        dataset = eval_set.dataset
        started = time.perf_counter()
        n = dataset.n_samples_per_prompt
        client = self.clients[dataset.name]
        client.context = f"eval {dataset.name} at rollout {rollout_id}"
        sampling = SamplingParams(
            temperature=dataset.temperature,
            top_p=dataset.top_p,
            max_new_tokens=dataset.max_new_tokens or self.config.rollout.max_new_tokens,
            stop_token_ids=client.stop_token_ids,
        )
        seed = eval_seed(self.config.seed, dataset.name, rollout_id)
        samples = [
            RolloutSample(row=row, seed=seed + k * n + j, sampling=sampling, adapter=self.adapter)
            for k, row in enumerate(self.rows[dataset.name])
            for j in range(n)
        ]
        # Never more at once than a rollout asks of the engines.
        batch = self.config.samples_per_rollout
        records: list[SampleRecord] = []
        for start in range(0, len(samples), batch):
            records += self.generate_fn(client, samples[start : start + batch])
            if len(samples) > batch:
                log.info("%s: %d of %d samples", client.context, len(records), len(samples))
        rewards = [r.reward for r in records]
        record: dict[str, Any] = {"rollout_id": rollout_id, "eval": dataset.name}
        if self.adapter:
            record["adapter"] = self.adapter
        record.update(
            weight_version=min(r.weight_version for r in records),
            **eval_metrics(rewards, n, dataset.pass_threshold),
            prompts=len(self.rows[dataset.name]),
            samples=len(records),
            failed_samples=sum(r is None for r in rewards),
            truncated_fraction=float(np.mean([r.status == "truncated" for r in records])),
            response_length_mean=float(np.mean([len(r.response_ids) for r in records])),
            time_eval=time.perf_counter() - started,
            finished_at=time.time(),
        )
        return record
