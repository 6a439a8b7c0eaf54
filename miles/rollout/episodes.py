"""Multi-turn episodes on the engines, token-exact: the generate function used when `rollout.env` is set.

    for each sample: env = Env(row); ids = prompt(env.reset())
    while some episodes run:
        one engine call for every running episode, each continuing from its whole id sequence so far
        append each model turn (loss mask 1, its log-probs)
        env.step(turn text) of every episode, concurrently: reward contribution, done, reply
        append each reply, tokenized once (loss mask 0)
    env.finish(reason); reward = the sum of the contributions

An episode's ids are built by appending, never by re-tokenizing the conversation: model tokens as the engine
generated them, each environment reply tokenized on its own. In an episode whose prompt went through the chat
template, a reply goes through it too, as the messages that follow the model's turn (with the template's turn
markers and the next generation prompt). Limits: `rollout.max_turns` model turns, `rollout.max_episode_tokens`
tokens after the prompt; an episode stopped by one, or by a model turn cut at `max_new_tokens`, is `truncated`.
An environment call that raises or outlasts `rollout.env_step_timeout_s` ends its episode as `failed`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from miles.concurrency import call_within, run_in_own_loop
from miles.engines.base import GenerateRequest, GenerateResult
from miles.envs.base import Observation, StepResult, resolve_environment
from miles.rewards.scoring import clip, finite_reward
from miles.rollout.generation import GenerateClient, RolloutSample, SampleRecord
from miles.state.seeds import turn_seed

log = logging.getLogger(__name__)


class EnvFailed(Exception):
    """An environment call raised, outlasted its time limit, or gave something unusable."""

    def __init__(self, reason: str, why: str):
        super().__init__(why)
        self.reason = reason  # env_error or env_timeout


@dataclass
class _Episode:
    sample: RolloutSample
    env: Any = None
    prompt: str = ""
    prompt_ids: list[int] = field(default_factory=list)
    templated: bool = False
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    token_rewards: list[float] = field(default_factory=list)  # each contribution at the last model token before it
    last_model_token: int | None = None
    reward: float = 0.0
    turns: int = 0
    weight_version: int | None = None
    end_reason: str | None = None  # set when the episode ends
    failure: str | None = None

    def append_model_turn(self, result: GenerateResult) -> None:
        self.response_ids += result.output_ids
        self.logprobs += result.logprobs
        self.mask += [1] * len(result.output_ids)
        self.versions += result.weight_versions
        self.token_rewards += [0.0] * len(result.output_ids)
        if result.output_ids:
            self.last_model_token = len(self.response_ids) - 1
        self.turns += 1
        version = result.weight_version
        self.weight_version = version if self.weight_version is None else min(self.weight_version, version)

    def append_reply(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.versions += [self.versions[-1]] * len(ids)  # a reply follows a model turn: its version
        self.token_rewards += [0.0] * len(ids)

    def credit(self, reward: float) -> None:
        """Add a reward contribution to the episode's, at its last model token so far (the turn it rewards)."""
        self.reward += reward
        if self.last_model_token is not None:
            self.token_rewards[self.last_model_token] += reward

    def fail(self, error: EnvFailed) -> None:
        self.end_reason, self.failure = error.reason, str(error)

    def record(self) -> SampleRecord:
        failed = self.failure is not None
        return SampleRecord(
            prompt=self.prompt,
            prompt_ids=self.prompt_ids,
            response_ids=self.response_ids,
            rollout_logprobs=self.logprobs,
            loss_mask=self.mask,
            reward=None if failed else self.reward,
            status="failed" if failed else "completed" if self.end_reason == "done" else "truncated",
            weight_version=self.weight_version,
            num_turns=self.turns,
            end_reason=self.end_reason,
            weight_versions=self.versions,
            token_rewards=None if failed else self.token_rewards,
        )


class ReplyEncoder:
    """An environment's reply as the token ids appended after the model's turn."""

    # The conversation a reply is rendered after, to cut the template's rendering of the reply from it.
    _BEFORE = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "!"}]

    def __init__(self, tokenizer, stop_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.stop_tokens = [t for t in tokenizer.convert_ids_to_tokens(list(stop_token_ids)) if t]

    def encode(self, observation: Observation, templated: bool) -> list[int]:
        if not templated:
            if not isinstance(observation, str):
                raise ValueError(
                    "the reply is chat messages, but the episode's prompt did not go through a chat template: reply "
                    "with text, or set data.apply_chat_template=true"
                )
            return self.tokenizer(observation, add_special_tokens=False)["input_ids"]
        return self.tokenizer(self._templated_text(observation), add_special_tokens=False)["input_ids"]

    def _templated_text(self, observation: Observation) -> str:
        """The template's text for the reply's messages and the next generation prompt, including what the template
        puts after the end-of-turn token that ended the model's turn (a newline, in many templates)."""
        messages = [{"role": "user", "content": observation}] if isinstance(observation, str) else observation
        before = self.tokenizer.apply_chat_template(self._BEFORE, tokenize=False)
        after = self.tokenizer.apply_chat_template(self._BEFORE + messages, tokenize=False, add_generation_prompt=True)
        if not after.startswith(before):
            raise ValueError("the chat template renders earlier turns differently once a reply follows them")
        end_of_turn = max((before.rfind(t) + len(t) for t in self.stop_tokens if t in before), default=len(before))
        return before[end_of_turn:] + after[len(before) :]


class EpisodeRunner:
    """Runs a batch of episodes of the environment class `env_class` through `client`."""

    def __init__(self, client: GenerateClient, env_class: type):
        self.client = client
        self.env_class = env_class
        rollout = client.config.rollout
        self.max_turns = rollout.max_turns
        self.max_episode_tokens = rollout.max_episode_tokens
        self.context = client.context_length
        self.timeout_s = rollout.env_step_timeout_s
        self.replies = ReplyEncoder(client.tokenizer, client.stop_token_ids)

    def run(self, samples: list[RolloutSample]) -> list[SampleRecord]:
        """One record per sample, in order (miles.concurrency runs the environments' calls)."""
        workers = max(1, min(32, len(samples)))
        episodes = run_in_own_loop(lambda threads: self._run(samples, threads), workers, "env")
        # An episode whose environment failed before its first turn never reached the engines: it is stamped with
        # the version its batch-mates were generated with.
        versions = [e.weight_version for e in episodes if e.weight_version is not None]
        for episode in episodes:
            if episode.weight_version is None:
                episode.weight_version = min(versions, default=self.client.weight_version())
        failed = [e for e in episodes if e.failure is not None]
        if failed:
            log.warning(
                "%s: %d of %d episodes failed in rollout.env %r, stored as failed and not trained on; first: %s",
                self.client.context,
                len(failed),
                len(episodes),
                self.client.config.rollout.env,
                failed[0].failure,
            )
        return [e.record() for e in episodes]

    async def _run(self, samples: list[RolloutSample], threads: ThreadPoolExecutor) -> list[_Episode]:
        episodes = [_Episode(sample) for sample in samples]
        await asyncio.gather(*(self._start(e, threads) for e in episodes))
        loop = asyncio.get_running_loop()
        while running := [e for e in episodes if e.end_reason is None]:
            requests = [self._next_request(e) for e in running]
            results = await loop.run_in_executor(None, self.client.generate, requests)
            for episode, result in zip(running, results, strict=True):
                episode.append_model_turn(result)
            turns = self.client.decode([r.output_ids for r in results])
            stepping = []
            for episode, result, turn in zip(running, results, turns, strict=True):
                if self.client.stopped(result):
                    stepping.append((episode, turn))
                else:  # cut short: at the episode's token budget, or at max_new_tokens
                    budget_hit = len(episode.response_ids) >= self._budget(episode)
                    episode.end_reason = "max_episode_tokens" if budget_hit else "max_new_tokens"
            await asyncio.gather(*(self._step(e, turn, threads) for e, turn in stepping))
        await asyncio.gather(*(self._finish(e, threads) for e in episodes if e.failure is None))
        return episodes

    async def _start(self, episode: _Episode, threads: ThreadPoolExecutor) -> None:
        try:
            episode.env = await self._call(threads, self.env_class, episode.sample.row, what="the constructor")
            observation = await self._call(threads, episode.env.reset, what="reset()")
            if not isinstance(observation, str | list):
                raise EnvFailed("env_error", f"reset() returned {clip(repr(observation))}, not text or chat messages")
            self._check_observation(observation, "reset()")
            (episode.prompt,), (episode.prompt_ids,) = self.client.encode_prompts([observation])
            episode.templated = self.client.prompts.templated(observation)
            if self._budget(episode) <= 0:
                episode.end_reason = "max_episode_tokens"  # the prompt leaves the model no room
        except EnvFailed as error:
            episode.fail(error)

    def _budget(self, episode: _Episode) -> int:
        """Tokens the episode may hold after its prompt: rollout.max_episode_tokens, within the model's context."""
        room = self.context - len(episode.prompt_ids)
        return room if self.max_episode_tokens is None else min(self.max_episode_tokens, room)

    def _next_request(self, episode: _Episode) -> GenerateRequest:
        sampling = episode.sample.sampling
        budget = self._budget(episode) - len(episode.response_ids)
        return GenerateRequest(
            prompt_ids=episode.prompt_ids + episode.response_ids,
            sampling=dataclasses.replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget)),
            adapter=episode.sample.adapter,
            seed=turn_seed(episode.sample.seed, episode.turns),
        )

    async def _step(self, episode: _Episode, turn: str, threads: ThreadPoolExecutor) -> None:
        try:
            outcome = await self._call(threads, episode.env.step, turn, what=f"step() of turn {episode.turns}")
            if not isinstance(outcome, StepResult):
                raise EnvFailed("env_error", f"step() returned {clip(repr(outcome))}, not a StepResult")
            episode.credit(_finite(outcome.reward, "step()"))
            if outcome.done:
                episode.end_reason = "done"
                return
            if episode.turns >= self.max_turns:
                episode.end_reason = "max_turns"
                return
            self._check_observation(outcome.observation, "step()")
            try:
                reply = self.replies.encode(outcome.observation, episode.templated)
            except ValueError as exc:
                raise EnvFailed("env_error", f"step() reply: {exc}") from None
            if len(episode.response_ids) + len(reply) >= self._budget(episode):
                episode.end_reason = "max_episode_tokens"  # no room left for the model to answer the reply
                return
            episode.append_reply(reply)
        except EnvFailed as error:
            episode.fail(error)

    async def _finish(self, episode: _Episode, threads: ThreadPoolExecutor) -> None:
        finish = getattr(episode.env, "finish", None)
        if finish is None:
            return
        try:
            extra = await self._call(threads, finish, episode.end_reason, what="finish()")
            episode.credit(0.0 if extra is None else _finite(extra, "finish()"))
        except EnvFailed as error:
            episode.fail(error)

    async def _call(self, threads: ThreadPoolExecutor, fn: Callable, *args: Any, what: str) -> Any:
        """`fn(*args)` within the time limit, awaited when it is a coroutine function; else EnvFailed."""
        try:
            return await call_within(threads, self.timeout_s, fn, *args)
        except TimeoutError:
            raise EnvFailed(
                "env_timeout", f"{what} timed out after {self.timeout_s:g} s (rollout.env_step_timeout_s)"
            ) from None
        except Exception as exc:  # an environment can fail on any input; only its episode fails
            raise EnvFailed("env_error", f"{what} raised {type(exc).__name__}: {exc}") from None

    @staticmethod
    def _check_observation(observation: Observation | None, what: str) -> None:
        if isinstance(observation, str):
            return
        if isinstance(observation, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in observation
        ):
            return
        raise EnvFailed("env_error", f"{what} gave {clip(repr(observation))}: not text or chat messages")


def _finite(value: Any, what: str) -> float:
    reward = finite_reward(value)
    if reward is None:
        raise EnvFailed("env_error", f"{what} gave the reward {clip(repr(value))}, not a finite number")
    return reward


def run_episodes(client: GenerateClient, samples: list[RolloutSample]) -> list[SampleRecord]:
    """The built-in generate function for `rollout.env`: one episode per sample."""
    return EpisodeRunner(client, resolve_environment(client.config.rollout.env)).run(samples)
