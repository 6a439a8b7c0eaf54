"""RolloutExecutor: `generate(rollout_id)` samples, scores and stores a rollout; `get(rollout_id)` hands it over."""

from __future__ import annotations

import logging
import math
import numbers

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from miles.config import RunConfig
from miles.data import DataSource
from miles.engines.base import GenerateRequest, SamplingParams
from miles.rewards import RewardFn
from miles.rollout.inference_controller import InferenceController
from miles.rollout.schema import ROLLOUT_SCHEMA, rollout_metadata, samples_table, with_rollout_metadata
from miles.rollout.store import RolloutStore
from miles.seeds import rollout_seed
from miles.train.advantages import grpo_advantages

log = logging.getLogger(__name__)


class RolloutExecutor:
    def __init__(
        self,
        config: RunConfig,
        controller: InferenceController,
        tokenizer,
        data_source: DataSource,
        store: RolloutStore,
        reward_fn: RewardFn,
        adapter: str | None = None,
    ):
        self.config = config
        self.adapter = adapter
        self.controller = controller
        self.tokenizer = tokenizer
        self.data_source = data_source
        self.store = store
        self.reward_fn = reward_fn
        self.sampling = SamplingParams(
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            max_new_tokens=config.rollout.max_new_tokens,
            stop_token_ids=(tokenizer.eos_token_id,),
        )

    def generate(self, rollout_id: int) -> dict[str, float]:
        """Produce rollout `rollout_id` unless its file exists (a retry or a resumed run reuses it)."""
        if self.store.exists(rollout_id):
            table = self.store.read(rollout_id)
            self.data_source.position = int(rollout_metadata(table)["data_position_end"])
            return summarize(table)
        cfg = self.config.rollout
        rows = self.data_source.peek(cfg.rollout_batch_size)
        prompt_ids = self.tokenizer([r["prompt"] for r in rows])["input_ids"]
        n = cfg.n_samples_per_prompt
        first_index = rollout_id * self.config.samples_per_rollout
        seed = rollout_seed(self.config.seed, rollout_id)
        requests = [
            GenerateRequest(prompt_ids=ids, sampling=self.sampling, adapter=self.adapter, seed=seed + k * n + j)
            for k, ids in enumerate(prompt_ids)
            for j in range(n)
        ]
        results = self.controller.generate(requests)

        labels = [r["label"] for r in rows for _ in range(n)]
        eos = self.tokenizer.eos_token_id
        texts = self.tokenizer.batch_decode([r.output_ids for r in results], skip_special_tokens=True)
        finished = [r.finish_reason == "stop" and r.output_ids[-1:] == [eos] for r in results]
        rewards, failures = self._score(texts, labels, finished)
        if failures:
            index, why = failures[0]
            log.warning(
                "rollout %d: data.reward %r failed on %d of %d samples, which are stored as failed and not trained on; "
                "first: sample %d (response %s) %s",
                rollout_id,
                self.config.data.reward,
                len(failures),
                len(texts),
                index,
                _clip(repr(texts[index])),
                why,
            )

        statuses = [
            "failed" if r is None else "completed" if f else "truncated" for r, f in zip(rewards, finished, strict=True)
        ]
        groups = np.repeat(np.arange(rollout_id * cfg.rollout_batch_size, (rollout_id + 1) * cfg.rollout_batch_size), n)
        table = samples_table(
            requests,
            results,
            rollout_id=rollout_id,
            first_index=first_index,
            group_index=groups,
            raw_reward=rewards,
            status=statuses,
            label=labels,
        )
        end = self.data_source.position + cfg.rollout_batch_size
        table = with_rollout_metadata(
            table, rollout_id=rollout_id, algorithm=self.config.algo.advantage_estimator, data_position_end=end
        )
        self.store.write(rollout_id, table)
        self.data_source.position = end
        return summarize(table)

    def _score(
        self, texts: list[str], labels: list[str], finished: list[bool]
    ) -> tuple[list[float | None], list[tuple[int, str]]]:
        """Each sample's reward, None where the reward function raised or returned no finite number; and the
        (index, what went wrong) of each such sample."""
        rewards: list[float | None] = []
        failures: list[tuple[int, str]] = []
        for index, (text, label, done) in enumerate(zip(texts, labels, finished, strict=True)):
            try:
                value = self.reward_fn(text, label, done)
            except Exception as exc:  # a user's reward function can fail on any response; only that sample fails
                failures.append((index, f"raised {type(exc).__name__}: {exc}"))
                rewards.append(None)
                continue
            if isinstance(value, numbers.Real) and math.isfinite(value):
                rewards.append(float(value))
            else:
                failures.append((index, f"returned {_clip(repr(value))}"))
                rewards.append(None)
        return rewards, failures

    def get(self, rollout_id: int, trainer_version: int) -> tuple[pa.Table, dict[str, float]]:
        """The stored rollout, ready to train: stale groups dropped, group-normalised advantages, trimmed to a
        multiple of global_batch_size. Failed samples are left out first, so advantages are normalised over the
        rest of each group. Also returns the handover's counts (staleness, dropped groups, failed samples)."""
        table = self.store.read(rollout_id)
        failed = pc.equal(table.column("status").cast(pa.string()), "failed")
        failed_samples = pc.sum(failed).as_py() or 0
        if failed_samples:  # a filter copies every column: only when there is something to leave out
            table = table.filter(pc.invert(failed))
        groups = table.column("group_index").to_numpy()
        staleness = trainer_version - table.column("weight_version").to_numpy()
        bound = self.config.rollout.max_weight_staleness
        dropped_groups = 0
        if bound is not None:
            stale_groups = np.unique(groups[staleness > bound])
            dropped_groups = len(stale_groups)
            if dropped_groups:
                keep_rows = ~np.isin(groups, stale_groups)
                table, groups, staleness = table.filter(pa.array(keep_rows)), groups[keep_rows], staleness[keep_rows]
        gbs = self.config.train.global_batch_size
        if table.num_rows < gbs:
            removals = []
            if failed_samples:
                removals.append(f"excluding {failed_samples} failed samples")
            if dropped_groups:
                removals.append(f"dropping {dropped_groups} groups staler than rollout.max_weight_staleness={bound}")
            why = f"after {' and '.join(removals)} " if removals else ""
            raise ValueError(
                f"rollout {rollout_id} has {table.num_rows} samples {why}(trainer at weight version {trainer_version}), "
                f"fewer than train.global_batch_size ({gbs})"
            )
        advantages = grpo_advantages(
            table.column("raw_reward").to_numpy(), groups, std_normalization=self.config.algo.grpo_std_normalization
        )
        table = table.set_column(
            table.schema.get_field_index("advantage"), ROLLOUT_SCHEMA.field("advantage"), pa.array(advantages)
        )
        stats = {
            "staleness_mean": float(staleness.mean()),
            "dropped_groups": dropped_groups,
            "failed_samples": failed_samples,
        }
        return table.slice(0, table.num_rows - table.num_rows % gbs), stats


def _clip(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def summarize(table: pa.Table) -> dict[str, float]:
    status = table.column("status").cast(pa.string())
    reward_mean = pc.mean(table.column("raw_reward")).as_py()  # skips the nulls of failed samples
    return {
        "reward_mean": math.nan if reward_mean is None else reward_mean,
        "response_length_mean": float(pc.mean(table.column("response_length")).as_py()),
        "truncated_fraction": float(pc.mean(pc.equal(status, "truncated").cast(pa.float32())).as_py()),
        "samples": table.num_rows,
        "failed_samples": pc.sum(pc.equal(status, "failed")).as_py() or 0,
        "weight_version": int(pc.min(table.column("weight_version")).as_py()),
    }
