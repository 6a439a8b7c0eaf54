"""Rewards computed by models, both batched over a rollout round (`score_batch`), started on their first call and
closed with the run:
- `GenerativeJudge` (data.reward=judge): a causal LM asked for a verdict on each sample, served by engines of its
  own through an InferenceController, greedy;
- `RewardModel` (data.reward=reward_model): a sequence-classification model's score of prompt + response, in a Ray
  actor of its own.

A response that did not finish (cut at max_new_tokens) scores 0 without being judged, as with every built-in reward.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

import ray
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from miles.cluster.actors import actor_options
from miles.cluster.placement import torch_device
from miles.config import JudgeConfig, RewardModelConfig, RolloutConfig
from miles.data.prompts import PromptFormatter
from miles.engines.base import GenerateRequest, SamplingParams, eos_token_ids
from miles.registry import import_callable
from miles.rollout.inference_controller import InferenceController

Verdict = Callable[[str, str, str], float | None]  # (the judge's reply, the response, the label) -> reward


def yes_no(reply: str, response: str, label: str) -> float | None:
    """1 for a reply whose first yes or no (a whole word, any case) is yes, 0 for no; None for neither."""
    found = re.search(r"\b(yes|no)\b", reply, re.IGNORECASE)
    return None if found is None else float(found.group(1).lower() == "yes")


def score(reply: str, response: str, label: str) -> float | None:
    """The reply's first number (a judge asked for a grade); None when it has none."""
    found = re.search(r"[-+]?\d+(?:\.\d+)?", reply)
    return None if found is None else float(found.group())


def same_answer(reply: str, response: str, label: str) -> float:
    """1 when the judge, asked the question itself, answers as the response does (both stripped), else 0."""
    return float(reply.strip() == response.strip())


VERDICTS: dict[str, Verdict] = {"yes_no": yes_no, "score": score, "same_answer": same_answer}


def resolve_verdict(name: str) -> Verdict:
    return VERDICTS[name] if name in VERDICTS else import_callable("judge.verdict", name)


class GenerativeJudge:
    def __init__(self, judge: JudgeConfig, rollout: RolloutConfig):
        self.config = judge
        self.verdict = resolve_verdict(judge.verdict)
        self._rollout = rollout.model_copy(update={"num_engines": judge.num_engines})
        self._lock = threading.Lock()
        self._controller = None
        self._prompts = None
        self._stop_ids: tuple[int, ...] = ()

    def _started(self) -> InferenceController:
        with self._lock:
            if self._controller is None:
                tokenizer = AutoTokenizer.from_pretrained(self.config.model_path)
                self._prompts = PromptFormatter(tokenizer, self.config)
                self._stop_ids = eos_token_ids(tokenizer)
                self._controller = InferenceController(str(self.config.model_path), 0, self._rollout)
            return self._controller

    def replies(self, prompts: list[str], responses: list[str], labels: list[str]) -> list[str]:
        """The judge's greedy reply to each sample's judge prompt (prompt_template filled in)."""
        controller = self._started()
        texts = [
            self.config.prompt_template.format(prompt=p, response=r, label=la)
            for p, r, la in zip(prompts, responses, labels, strict=True)
        ]
        _, ids = self._prompts.encode(texts)
        sampling = SamplingParams(
            temperature=0.0, max_new_tokens=self.config.max_new_tokens, stop_token_ids=self._stop_ids
        )
        results = controller.generate([GenerateRequest(prompt_ids=i, sampling=sampling) for i in ids])
        return self._prompts.tokenizer.batch_decode([r.output_ids for r in results], skip_special_tokens=True)

    def score_batch(
        self, prompts: list[str], responses: list[str], labels: list[str], finished: list[bool]
    ) -> list[float | None]:
        judged = [i for i, done in enumerate(finished) if done]
        rewards: list[float | None] = [0.0] * len(responses)
        if judged:
            replies = self.replies(*([values[i] for i in judged] for values in (prompts, responses, labels)))
            for i, reply in zip(judged, replies, strict=True):
                rewards[i] = self.verdict(reply, responses[i], labels[i])
        return rewards

    def close(self) -> None:
        with self._lock:
            if self._controller is not None:
                self._controller.shutdown()
                self._controller = None


class RewardModelActor:
    """The reward model in a process of its own: prompt + response texts in, one score each out."""

    def __init__(self, config: RewardModelConfig):
        torch.set_num_threads(config.num_threads)
        self.config = config
        self.device = torch_device(config.device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        self.tokenizer.padding_side = "right"  # the model reads its score at the last token that is not padding
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        model = AutoModelForSequenceClassification.from_pretrained(config.model_path, dtype=torch.float32)
        if model.config.num_labels != 1:
            raise ValueError(
                f"reward_model.model_path: {config.model_path} has {model.config.num_labels} labels; a reward model "
                "has one (its score)"
            )
        model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model = model.eval().to(self.device)

    @torch.no_grad()
    def score(self, texts: list[str]) -> list[float]:
        scores: list[float] = []
        for start in range(0, len(texts), self.config.batch_size):
            batch = self.tokenizer(texts[start : start + self.config.batch_size], padding=True, return_tensors="pt")
            logits = self.model(**{k: v.to(self.device) for k, v in batch.items()}).logits
            scores += logits[:, 0].float().cpu().tolist()
        return scores


class RewardModel:
    def __init__(self, config: RewardModelConfig):
        self.config = config
        self._lock = threading.Lock()
        self._actor = None

    def _started(self):
        with self._lock:
            if self._actor is None:
                options = actor_options(self.config.device)
                self._actor = ray.remote(RewardModelActor).options(**options).remote(self.config)
            return self._actor

    def score_batch(
        self, prompts: list[str], responses: list[str], labels: list[str], finished: list[bool]
    ) -> list[float]:
        scored = [i for i, done in enumerate(finished) if done]
        rewards = [0.0] * len(responses)
        if scored:
            texts = [prompts[i] + responses[i] for i in scored]
            for i, value in zip(scored, ray.get(self._started().score.remote(texts)), strict=True):
                rewards[i] = value
        return rewards

    def close(self) -> None:
        with self._lock:
            if self._actor is not None:
                ray.kill(self._actor)
                self._actor = None
