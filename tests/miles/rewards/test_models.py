"""Rewards computed by models (miles.rewards.models), on models built in the tests: the generative judge on the
embedded model served by engines of its own, the reward model on a sequence-classification model made from it; and
both as a run's data.reward."""

from __future__ import annotations

import pyarrow as pa
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from miles.engines.base import GenerateRequest, SamplingParams, eos_token_ids
from miles.engines.torch_engine import TorchEngine
from miles.loop import run_sync
from miles.rewards.models import GenerativeJudge, RewardModel, same_answer, score, yes_no
from miles.state.run_dir import RunDir

PROMPTS = ["12+30=", "7+8=", "45+5=", "3+3="]


def test_verdicts_read_the_judges_reply():
    assert [yes_no(r, "", "") for r in ("Yes, it is right.", "NO.", "It is wrong", "nobody knows")] == [
        1.0,
        0.0,
        None,  # no verdict: the sample fails
        None,  # a word that starts with "no" is not one
    ]
    assert score("Grade: 7.5 out of 10", "", "") == 7.5 and score("no grade", "", "") is None
    assert same_answer(" 42 ", "42", "") == 1.0 and same_answer("42", "43", "") == 0.0


def _greedy_answers(model_dir, prompts: list[str], max_new_tokens: int) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=eos_token_ids(tokenizer))
    requests = [GenerateRequest(prompt_ids=ids, sampling=sampling) for ids in tokenizer(prompts)["input_ids"]]
    results = TorchEngine(str(model_dir), num_threads=1).generate(requests)
    return tokenizer.batch_decode([r.output_ids for r in results], skip_special_tokens=True)


JUDGE = ["data.reward=judge", "judge.prompt_template={prompt}", "judge.verdict=same_answer", "judge.max_new_tokens=4"]


def test_a_judge_on_engines_of_its_own_scores_a_batch_by_its_verdicts(ray_session, small_config, tiny_model_dir):
    config = small_config(*JUDGE, f"judge.model_path={tiny_model_dir}")
    judge = GenerativeJudge(config.judge, config.rollout)
    own = _greedy_answers(tiny_model_dir, PROMPTS, 4)
    responses = [own[0], own[1] + "1", own[2], own[3]]
    try:
        rewards = judge.score_batch(PROMPTS, responses, ["?"] * 4, [True, True, True, False])
        assert rewards == [1.0, 0.0, 1.0, 0.0]  # the last did not finish: 0 without asking the judge
        assert len(judge._controller.engines) == 1
    finally:
        judge.close()
    assert judge._controller is None


@pytest.fixture(scope="module")
def reward_model_dir(tiny_model_dir, tmp_path_factory):
    """The embedded model with a score head of one label: a reward model built in seconds."""
    directory = tmp_path_factory.mktemp("reward-model")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=1)
    model.config.pad_token_id = AutoTokenizer.from_pretrained(tiny_model_dir).pad_token_id
    model.save_pretrained(directory)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(directory)
    return directory


def _scores(model_dir, texts: list[str]) -> list[float]:
    """Each text scored alone: no padding."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return [float(model(**tokenizer(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def test_a_reward_model_scores_prompt_and_response_in_padded_batches(ray_session, small_config, reward_model_dir):
    config = small_config("data.reward=reward_model", f"reward_model.model_path={reward_model_dir}")
    reward = RewardModel(config.reward_model.model_copy(update={"batch_size": 2}))
    responses = ["42", "15", "5000", "6"]
    try:
        rewards = reward.score_batch(PROMPTS, responses, ["?"] * 4, [True, True, True, False])
    finally:
        reward.close()
    expected = _scores(reward_model_dir, [p + r for p, r in zip(PROMPTS[:3], responses[:3], strict=True)])
    torch.testing.assert_close(torch.tensor(rewards[:3]), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert rewards[3] == 0.0 and len(set(rewards[:3])) == 3


def _stored(run_dir) -> pa.Table:
    return pa.ipc.open_file(str(RunDir(run_dir).rollouts / "rollout_0.arrow")).read_all()


def test_a_run_rewarded_by_a_judge_and_one_by_a_reward_model(
    ray_session, small_config, tiny_model_dir, reward_model_dir, tmp_path
):
    judged = small_config(*JUDGE, f"judge.model_path={tiny_model_dir}", num_rollout=1, run_dir=str(tmp_path / "judge"))
    run_sync(judged)
    table = _stored(judged.run_dir)
    finished = [s == "completed" for s in table.column("status").to_pylist()]
    prompts = table.column("prompt").to_pylist()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    responses = tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True)
    own = _greedy_answers(tiny_model_dir, prompts, 4)
    expected = [float(done and r.strip() == o.strip()) for done, r, o in zip(finished, responses, own, strict=True)]
    assert table.column("raw_reward").to_pylist() == expected

    scored = small_config(
        "data.reward=reward_model",
        f"reward_model.model_path={reward_model_dir}",
        num_rollout=1,
        run_dir=str(tmp_path / "rm"),
    )
    run_sync(scored)
    table = _stored(scored.run_dir)
    texts = [
        p + r
        for p, r in zip(
            table.column("prompt").to_pylist(),
            tokenizer.batch_decode(table.column("response_ids").to_pylist(), skip_special_tokens=True),
            strict=True,
        )
    ]
    finished = [s == "completed" for s in table.column("status").to_pylist()]
    expected = [s if done else 0.0 for s, done in zip(_scores(reward_model_dir, texts), finished, strict=True)]
    torch.testing.assert_close(
        torch.tensor(table.column("raw_reward").to_pylist()), torch.tensor(expected), atol=1e-4, rtol=1e-4
    )
