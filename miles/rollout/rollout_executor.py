"""RolloutExecutor: `generate(rollout_id)` samples, scores and stores a rollout; `get(rollout_id)` hands it over."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import math
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from miles.config import RunConfig
from miles.config.base import changes_freely
from miles.data import DataSource
from miles.engines.base import SamplingParams
from miles.rewards import MODEL_REWARDS, RewardFn
from miles.rewards.scoring import clip
from miles.rollout.generation import GenerateClient, RolloutSample, SampleRecord, resolve_generate_fn
from miles.rollout.handover import (
    Handover,
    dynamic_sampling,
    shaped_scores,
    split_evenly,
    with_advantages,
    without_failed,
    without_stale_groups,
)
from miles.rollout.inference_controller import InferenceController
from miles.rollout.schema import records_table, rollout_metadata, with_rollout_metadata
from miles.rollout.store import DamagedRollout, RolloutStore
from miles.state.seeds import rollout_seed
from miles.train.algorithms import resolve_estimator

log = logging.getLogger(__name__)


def scorer_identity(config: RunConfig, reward: RewardFn | object) -> str:
    """What scores a rollout's samples, stored with it: the reward (and the environment and generate_fn, when set) by
    its config value and a hash of the source file it comes from, so that a reward fixed in place reads as another."""
    name = config.data.reward
    if name in MODEL_REWARDS:  # a model scores: its settings say what it gives, except those that change freely
        section = getattr(config, name)
        resources = {field for field in type(section).model_fields if changes_freely(RunConfig, f"{name}.{field}")}
        settings = section.model_dump(mode="json", exclude=resources)
        name = f"{name}{json.dumps(settings, sort_keys=True)}"
    scorers = {"data.reward": (name, reward)}
    if config.rollout.env is not None:
        from miles.envs.base import resolve_environment

        scorers["rollout.env"] = (config.rollout.env, resolve_environment(config.rollout.env))
    if config.rollout.generate_fn is not None:
        scorers["rollout.generate_fn"] = (config.rollout.generate_fn, resolve_generate_fn(config))
    parts = []
    for field, (name, scorer) in scorers.items():
        digest = _source_digest(scorer if inspect.isfunction(scorer) or inspect.isclass(scorer) else type(scorer))
        parts.append(f"{field}={name}@{digest}")
    return ";".join(parts)


def _source_digest(code: object) -> str:
    """A hash of the source file that defines `code`; "unknown" for code without one (a built-in)."""
    try:
        source = inspect.getsourcefile(code)
    except TypeError:
        source = None
    return hashlib.sha256(Path(source).read_bytes()).hexdigest()[:12] if source else "unknown"


class RolloutExecutor:
    def __init__(
        self,
        config: RunConfig,
        controller: InferenceController,
        tokenizer,
        data_source: DataSource,
        store: RolloutStore,
        reward: RewardFn | object,
        adapter: str | None = None,
    ):
        self.config = config
        self.adapter = adapter
        self.data_source = data_source
        self.store = store
        self.client = GenerateClient(controller, tokenizer, config, reward)
        self.generate_fn = resolve_generate_fn(config)
        self.scorer = scorer_identity(config, reward)
        self.sampling = SamplingParams(
            temperature=config.rollout.temperature,
            top_p=config.rollout.top_p,
            max_new_tokens=config.rollout.max_new_tokens,
            stop_token_ids=self.client.stop_token_ids,
        )
        self.estimator = resolve_estimator(config.algo)
        self.prompt_order = PromptOrder(config.rollout.rollout_batch_size, data_source.position)

    def generate(self, rollout_id: int) -> dict[str, float]:
        """Produce rollout `rollout_id` unless its file exists (a retry or a resumed run reuses it).

        Its prompts follow those of rollout_id - 1 (PromptOrder), whose generation may still run. With
        algo.dynamic_sampling, further rounds of rollout_batch_size prompts are drawn (up to
        rollout.max_generate_rounds in all) until rollout_batch_size groups have differing scores. All rounds go
        into the one rollout file, written once: a retry draws the same prompts and seeds again."""
        table = self._stored(rollout_id)
        if table is not None:
            self.prompt_order.ends_at(rollout_id, int(rollout_metadata(table)["data_position_end"]))
            return summarize(table)
        cfg = self.config.rollout
        start = self.prompt_order.start_of(rollout_id)
        rounds = cfg.max_generate_rounds if self.config.algo.dynamic_sampling else 1
        tables = [self._generate_round(rollout_id, start, 0)]
        while len(tables) < rounds:
            differing = self._differing_groups(pa.concat_tables(tables))
            if differing >= cfg.rollout_batch_size:
                break
            log.info(
                "rollout %d: %d of %d groups have differing rewards; drawing round %d of at most %d",
                rollout_id,
                differing,
                cfg.rollout_batch_size,
                len(tables) + 1,
                rounds,
            )
            tables.append(self._generate_round(rollout_id, start, len(tables)))
        end = start + len(tables) * cfg.rollout_batch_size
        table = with_rollout_metadata(
            # One dictionary per column across rounds: an Arrow IPC file holds one per field.
            pa.concat_tables(tables).unify_dictionaries().combine_chunks(),
            rollout_id=rollout_id,
            algorithm=self.config.algo.advantage_estimator,
            data_position_end=end,
            generate_rounds=len(tables),
            scorer=self.scorer,
        )
        self.store.write(rollout_id, table)
        self.prompt_order.ends_at(rollout_id, end)
        return summarize(table)

    def _stored(self, rollout_id: int) -> pa.Table | None:
        """The stored rollout, to reuse; None when there is none, or when it is set aside to be generated again: a
        damaged file, or one scored by another scorer than the run's (a reward fixed since). Only untrained rollouts
        are generated, so nothing trained is set aside."""
        if not self.store.exists(rollout_id):
            return None
        try:
            table = self.store.read(rollout_id)
        except DamagedRollout as exc:
            aside = self.store.set_aside(rollout_id, "damaged")
            log.warning("rollout %d is generated again: %s (moved to %s)", rollout_id, exc, aside)
            return None
        scorer = rollout_metadata(table).get("scorer")
        if scorer is not None and scorer != self.scorer:
            aside = self.store.set_aside(rollout_id, "rescored")
            log.warning(
                "rollout %d is generated again: it was scored by %s, and the run's scorer is now %s (moved to %s)",
                rollout_id,
                scorer,
                self.scorer,
                aside,
            )
            return None
        return table

    def _generate_round(self, rollout_id: int, start: int, round_: int) -> pa.Table:
        """One round's rollout_batch_size prompts x n_samples_per_prompt samples, produced by the generate function
        (scored). Round r of rollout i takes the prompts after those of rounds 0..r-1 (from `start`), and sample and
        group numbers of slot i * max_rounds + r, so they stay unique within the run."""
        cfg = self.config.rollout
        rows = self.data_source.rows_at(start + round_ * cfg.rollout_batch_size, cfg.rollout_batch_size)
        n = cfg.n_samples_per_prompt
        slot = rollout_id * cfg.max_generate_rounds + round_
        seed = rollout_seed(self.config.seed, rollout_id) + round_ * self.config.samples_per_rollout
        sampling = replace(self.sampling, temperature=self.config.at(rollout_id).rollout.temperature)
        samples = [
            RolloutSample(row=row, seed=seed + k * n + j, sampling=sampling, adapter=self.adapter)
            for k, row in enumerate(rows)
            for j in range(n)
        ]
        # ReMax: a greedy response to each prompt, generated in the same batch; its reward is the prompt's baseline.
        greedy_sampling = replace(sampling, temperature=0.0)
        greedy = [
            RolloutSample(row=row, seed=seed + k * n, sampling=greedy_sampling, adapter=self.adapter)
            for k, row in enumerate(rows)
            if self.estimator.needs_greedy_baseline
        ]
        self.client.context = f"rollout {rollout_id}"
        records = self.generate_fn(self.client, samples + greedy)
        _check_records(records, len(samples) + len(greedy), self.config.rollout.generate_fn)
        records, greedy_records = records[: len(samples)], records[len(samples) :]
        baselines = [r.reward for r in greedy_records for _ in range(n)] if greedy else None
        return records_table(
            records,
            rollout_id=rollout_id,
            first_index=slot * self.config.samples_per_rollout,
            group_index=np.repeat(np.arange(slot * cfg.rollout_batch_size, (slot + 1) * cfg.rollout_batch_size), n),
            adapter=[self.adapter] * len(samples),
            label=[s.row["label"] for s in samples],
            baseline_reward=baselines,
        )

    def _differing_groups(self, table: pa.Table) -> int:
        table, _ = without_failed(table)
        handover = Handover.of(table, 0, self._scores(table))
        return handover.group_count(~handover.equal_score_rows())

    def _scores(self, table: pa.Table) -> torch.Tensor:
        algo = self.config.algo
        return shaped_scores(table, self.config.rollout.max_new_tokens, algo.overlong_buffer_len, algo.overlong_penalty)

    def get(self, rollout_id: int, trainer_version: int) -> tuple[pa.Table, dict[str, float]]:
        """The stored rollout, ready to train (miles.rollout.handover): failed samples out first, so that a group's
        baseline is over the rest of it; groups staler than rollout.max_weight_staleness out; with
        algo.dynamic_sampling, groups whose scores are all equal out (and rollout_batch_size groups kept at most),
        unless fewer than global_batch_size samples would remain: then just enough of them stay; the fewest samples,
        as whole groups, that keep the trainer's workers from equal shares out (`uneven_groups`); then the advantages
        of what is left, from the run's estimator. Every other sample is trained on (the last optimizer step takes
        what is left of a global batch). Also returns the handover's counts (staleness, dropped and filtered groups,
        failed samples)."""
        table, failed_samples = without_failed(self.store.read(rollout_id))
        handover = Handover.of(table, trainer_version, self._scores(table))
        bound = self.config.rollout.max_weight_staleness
        handover, dropped_groups = without_stale_groups(handover, bound)
        gbs = self.config.train.global_batch_size
        if handover.table.num_rows < gbs:
            removals = []
            if failed_samples:
                removals.append(f"excluding {failed_samples} failed samples")
            if dropped_groups:
                removals.append(f"dropping {dropped_groups} groups staler than rollout.max_weight_staleness={bound}")
            why = f"after {' and '.join(removals)} " if removals else ""
            raise ValueError(
                f"rollout {rollout_id} has {handover.table.num_rows} samples {why}(trainer at weight version "
                f"{trainer_version}), fewer than train.global_batch_size ({gbs})"
            )
        dropped_samples = table.num_rows - handover.table.num_rows
        filtered_groups = 0
        if self.config.algo.dynamic_sampling:
            handover, filtered_groups = dynamic_sampling(handover, self.config.rollout.rollout_batch_size, gbs)
        balanced, uneven = split_evenly(handover, self._workers())
        values = self._critic_values(rollout_id, balanced.table) if self.estimator.needs_critic else None
        stats = {
            "staleness_mean": float(balanced.staleness.mean()),
            **_token_staleness(balanced.table, trainer_version),
            "dropped_groups": dropped_groups,
            "dropped_samples": dropped_samples,
            "failed_samples": failed_samples,
            "filtered_groups": filtered_groups,
            "uneven_groups": uneven,
            "uneven_samples": handover.table.num_rows - balanced.table.num_rows,
            # groups trained on whose scores are all equal: no signal under a group baseline
            "zero_advantage_groups": balanced.group_count(balanced.equal_score_rows()),
        }
        return with_advantages(balanced, self.estimator, values), stats

    def _workers(self) -> int:
        """The workers that split each rollout evenly: the policy's trainer ranks, and the critic's with one."""
        if self.estimator.needs_critic:
            return math.lcm(self.config.train.num_workers, self.config.critic.num_workers)
        return self.config.train.num_workers

    def _critic_values(self, rollout_id: int, table: pa.Table) -> pa.ListArray:
        """The critic's stored values of each sample's response tokens, row for row (compute_values stored them)."""
        stored = self.store.read_values(rollout_id)
        if stored is None:
            raise RuntimeError(
                f"rollout {rollout_id}: the critic's values are not stored ({self.store.values_path(rollout_id)}); "
                "compute_values runs before get"
            )
        row_of = {int(s): row for row, s in enumerate(stored.column("sample_index").to_numpy())}
        samples = table.column("sample_index").to_numpy()
        missing = [int(s) for s in samples if int(s) not in row_of]
        if missing:
            raise ValueError(f"{self.store.values_path(rollout_id)} has no values of samples {missing[:5]}")
        values = stored.column("values").take(pa.array([row_of[int(s)] for s in samples])).combine_chunks()
        lengths = table.column("response_length").to_numpy().astype(np.int64)
        if not np.array_equal(np.diff(values.offsets.to_numpy()), lengths):
            raise ValueError(f"{self.store.values_path(rollout_id)}: a sample's values do not match its response")
        return values


class PromptOrder:
    """Where each rollout's prompts end in the data walk; a rollout starts where the one before it ends. When that
    end is not known yet (its generation runs beside this one, in the fully-async flow, where every rollout draws
    one round), the start is counted on from the last end known, `batch_size` prompts per rollout."""

    def __init__(self, batch_size: int, position: int):
        self.batch_size = batch_size
        self._ends = {-1: position}
        self._lock = threading.Lock()

    def ends_at(self, rollout_id: int, position: int) -> None:
        with self._lock:
            self._ends[rollout_id] = position

    def end_of(self, rollout_id: int) -> int:
        return self._ends[rollout_id]

    def start_of(self, rollout_id: int) -> int:
        with self._lock:
            known = max(k for k in self._ends if k < rollout_id)
            return self._ends[known] + (rollout_id - 1 - known) * self.batch_size


def _check_records(records, expected: int, generate_fn: str | None) -> None:
    """A generate function gives one SampleRecord per sample it was given."""
    name = f"rollout.generate_fn {generate_fn!r}" if generate_fn else "the generate function"
    if not isinstance(records, list) or len(records) != expected:
        what = f"{len(records)} records" if isinstance(records, list) else clip(repr(records))
        raise ValueError(f"{name} returned {what} for {expected} samples")
    wrong = next((i for i, r in enumerate(records) if not isinstance(r, SampleRecord)), None)
    if wrong is not None:
        raise ValueError(f"{name}: record {wrong} is {clip(repr(records[wrong]))}, not a SampleRecord")


def _token_staleness(table: pa.Table, trainer_version: int) -> dict[str, float]:
    """Over the tokens trained on: how many versions each is behind the trainer, on average and at most; and the
    samples whose tokens come from more than one version (a push came while they were generated)."""
    versions = table.column("weight_versions").combine_chunks()
    mask = table.column("loss_mask").combine_chunks().flatten().to_numpy().astype(bool)
    token_versions = versions.flatten().to_numpy()
    behind = trainer_version - token_versions[mask]
    offsets = versions.offsets.to_numpy()
    starts = offsets[:-1][offsets[1:] > offsets[:-1]]  # a sample without tokens (an episode failed at once) spans none
    newest = np.maximum.reduceat(token_versions, starts) if len(starts) else np.array([], np.int32)
    oldest = np.minimum.reduceat(token_versions, starts) if len(starts) else np.array([], np.int32)
    return {
        "token_staleness_mean": float(behind.mean()) if len(behind) else 0.0,
        "token_staleness_max": int(behind.max()) if len(behind) else 0,
        "mixed_version_samples": int((newest != oldest).sum()),
    }


def summarize(table: pa.Table) -> dict[str, float]:
    status = table.column("status").cast(pa.string())
    reward_mean = pc.mean(table.column("raw_reward")).as_py()  # skips the nulls of failed samples
    return {
        "reward_mean": math.nan if reward_mean is None else reward_mean,
        "response_length_mean": float(pc.mean(table.column("response_length")).as_py()),
        "turns_mean": float(pc.mean(table.column("num_turns")).as_py()),
        "truncated_fraction": float(pc.mean(pc.equal(status, "truncated").cast(pa.float32())).as_py()),
        "samples": table.num_rows,
        "failed_samples": pc.sum(pc.equal(status, "failed")).as_py() or 0,
        "weight_version": int(pc.min(table.column("weight_version")).as_py()),
        "generate_rounds": int(rollout_metadata(table).get("generate_rounds", 1)),
    }
