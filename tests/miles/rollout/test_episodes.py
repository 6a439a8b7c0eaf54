"""Multi-turn episodes: ids built by appending engine tokens and tokenized replies, the loss mask, the limits and
the failures of environments, on a scripted engine and on the TorchEngine."""

from __future__ import annotations

import re

import pytest

from miles.config import ConfigError, RolloutConfig, load_config
from miles.engines.base import GenerateResult, SamplingParams
from miles.rollout.episodes import ReplyEncoder, run_episodes
from miles.rollout.generation import GenerateClient, RolloutSample, resolve_generate_fn
from miles.rollout.inference_controller import InferenceController
from miles.state.seeds import turn_seed
from tests.helpers.chat import build_chat_tokenizer

ENVS = "tests.miles.envs.envs_for_tests"
SUM = re.compile(r"(\d+)\+(\d+)=$")


class ScriptedClient(GenerateClient):
    """Answers the last question of each request's context (the text after its last EOS) with its sum; `answer`
    rewrites that answer. Records every call."""

    def __init__(self, tokenizer, config, answer=lambda text: text):
        super().__init__(None, tokenizer, config, None)
        self.answer = answer
        self.calls = []

    def generate(self, requests):
        self.calls.append(requests)
        eos = self.tokenizer.eos_token_id
        results = []
        for request in requests:
            ids = request.prompt_ids
            tail = ids[max((i for i, t in enumerate(ids) if t == eos), default=-1) + 1 :]
            a, b = SUM.search(self.tokenizer.decode(tail, skip_special_tokens=True)).groups()
            out = self.tokenizer(self.answer(str(int(a) + int(b))), add_special_tokens=False)["input_ids"] + [eos]
            cut = out[: request.sampling.max_new_tokens]
            logprobs = [-0.1 * (k + 1) for k in range(len(cut))]
            results.append(GenerateResult(cut, logprobs, "stop" if cut == out else "length", [7] * len(cut)))
        return results

    def weight_version(self):
        return 7


def _config(tiny_model_dir, env: str, *overrides: str):
    return load_config(None, [f"model.path={tiny_model_dir}", f"rollout.env={ENVS}:{env}", *overrides])


def _samples(tokenizer, prompts, labels=None, max_new_tokens=4):
    sampling = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=(tokenizer.eos_token_id,))
    labels = labels or [""] * len(prompts)
    return [
        RolloutSample(row={"prompt": p, "label": label}, seed=100 + k, sampling=sampling)
        for k, (p, label) in enumerate(zip(prompts, labels, strict=True))
    ]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("env", ["SumQuiz", "AsyncSumQuiz"])
def test_an_episodes_ids_are_the_engines_tokens_then_each_reply(tokenizer, tiny_model_dir, env):
    client = ScriptedClient(tokenizer, _config(tiny_model_dir, env))
    (record,) = run_episodes(client, _samples(tokenizer, ["12+30="]))

    eos = tokenizer.eos_token_id
    # turn 1 answers 12+30, the reply asks 1+1, turn 2 answers, the reply asks 2+2, turn 3 answers: done.
    turns = [_ids(tokenizer, answer) + [eos] for answer in ("42", "2", "4")]
    replies = [_ids(tokenizer, question) for question in ("1+1=", "2+2=")]
    assert record.prompt_ids == tokenizer("12+30=")["input_ids"] and record.prompt == "12+30="
    assert record.response_ids == turns[0] + replies[0] + turns[1] + replies[1] + turns[2]
    assert record.loss_mask == [1] * 3 + [0] * 4 + [1] * 2 + [0] * 4 + [1] * 2
    assert record.rollout_logprobs == pytest.approx(
        [-0.1, -0.2, -0.3] + [0.0] * 4 + [-0.1, -0.2] + [0.0] * 4 + [-0.1, -0.2]
    )
    assert (record.num_turns, record.status, record.end_reason) == (3, "completed", "done")
    assert record.reward == 3.5  # three right answers and the bonus finish() gives a quiz seen to its end
    # each answer's reward at its turn's last token, the finish() bonus at the last model token: a process reward
    assert record.token_rewards == [0, 0, 1.0] + [0] * 4 + [0, 1.0] + [0] * 4 + [0, 1.5]
    # Each turn continues from the whole sequence so far, with a seed of its own.
    requests = [call[0] for call in client.calls]
    assert [r.prompt_ids for r in requests] == [
        record.prompt_ids,
        record.prompt_ids + turns[0] + replies[0],
        record.prompt_ids + turns[0] + replies[0] + turns[1] + replies[1],
    ]
    assert [r.seed for r in requests] == [turn_seed(100, t) for t in range(3)] and len({r.seed for r in requests}) == 3


def test_running_episodes_advance_together_one_engine_call_per_turn(tokenizer, tiny_model_dir):
    client = ScriptedClient(tokenizer, _config(tiny_model_dir, "SumQuiz", "rollout.max_turns=2"))
    records = run_episodes(client, _samples(tokenizer, ["1+2=", "3+4=", "5+6="]))
    assert [len(call) for call in client.calls] == [3, 3]
    # Cut at max_turns: two right answers, less the penalty finish() gives a cut quiz.
    assert [(r.status, r.end_reason, r.num_turns, r.reward) for r in records] == [
        ("truncated", "max_turns", 2, 1.0)
    ] * 3


def test_environments_that_fail_end_their_own_episode_as_failed(tokenizer, tiny_model_dir, caplog):
    config = _config(tiny_model_dir, "BreaksOnLabel", "rollout.env_step_timeout_s=0.5")
    labels = ["raise", "block", "reset", "reward", "ok"]
    client = ScriptedClient(tokenizer, config)
    records = run_episodes(client, _samples(tokenizer, ["1+2="] * len(labels), labels))

    outcome = {label: (r.status, r.end_reason, r.reward) for label, r in zip(labels, records, strict=True)}
    assert outcome == {
        "raise": ("failed", "env_error", None),
        "block": ("failed", "env_timeout", None),
        "reset": ("failed", "env_error", None),
        "reward": ("failed", "env_error", None),
        "ok": ("completed", "done", 3.5),
    }
    assert records[2].num_turns == 0 and records[2].response_ids == [] and records[2].weight_version == 7
    assert "4 of 5 episodes failed" in caplog.text and "tool crashed" in caplog.text

    config = _config(tiny_model_dir, "HangsOnLabel", "rollout.env_step_timeout_s=0.5")
    records = run_episodes(ScriptedClient(tokenizer, config), _samples(tokenizer, ["1+2="] * 2, ["hang", "ok"]))
    assert [(r.status, r.end_reason) for r in records] == [("failed", "env_timeout"), ("completed", "done")]


def test_the_token_budget_and_max_new_tokens_cut_episodes(tokenizer, tiny_model_dir):
    # "12+30=" answered "42<eos>" (3 tokens), then the reply "12+30=" (6): 9 tokens. A budget of 8 leaves no room
    # for the reply (the episode ends before it), a budget of 2 cuts the first turn itself.
    for budget, expected in ((8, ("truncated", "max_episode_tokens", 3)), (2, ("truncated", "max_episode_tokens", 2))):
        config = _config(tiny_model_dir, "NeverDone", f"rollout.max_episode_tokens={budget}")
        (record,) = run_episodes(ScriptedClient(tokenizer, config), _samples(tokenizer, ["12+30="]))
        assert (record.status, record.end_reason, len(record.response_ids)) == expected
        assert len(record.response_ids) <= budget and record.loss_mask == [1] * expected[2]
    config = _config(tiny_model_dir, "SumQuiz")
    client = ScriptedClient(tokenizer, config, answer=lambda text: text * 3)
    (record,) = run_episodes(client, _samples(tokenizer, ["12+30="], max_new_tokens=4))
    assert (record.status, record.end_reason, record.num_turns, record.reward) == (
        "truncated",
        "max_new_tokens",
        1,
        -1.0,  # the cut turn is never stepped: only finish()'s penalty
    )


def test_replies_in_a_chat_episode_carry_the_templates_turn_markers():
    """The ids of prompt, model turn and reply are those of the template over the whole conversation."""
    tokenizer = build_chat_tokenizer(["user assistant tool What is 12+30? 42 The calculator says 42"])
    question = [{"role": "user", "content": "What is 12+30?"}]
    reply = [{"role": "tool", "content": "The calculator says 42"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=True)["input_ids"]
    turn = _ids(tokenizer, "42") + [tokenizer.eos_token_id]  # the model ends its turn with <|im_end|>
    encoder = ReplyEncoder(tokenizer, (tokenizer.eos_token_id,))

    whole = question + [{"role": "assistant", "content": "42"}] + reply
    expected = tokenizer.apply_chat_template(whole, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert prompt + turn + encoder.encode(reply, templated=True) == expected
    # A string reply is a user message.
    as_user = [*whole[:2], {"role": "user", "content": "The calculator says 42"}]
    expected = tokenizer.apply_chat_template(as_user, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert prompt + turn + encoder.encode("The calculator says 42", templated=True) == expected
    with pytest.raises(ValueError, match="did not go through a chat template"):
        encoder.encode(reply, templated=False)


def test_an_environment_that_cannot_be_imported_is_refused_before_any_work(tiny_model_dir):
    with pytest.raises(ValueError, match="rollout.env: cannot import 'nowhere.envs:Env'"):
        resolve_generate_fn(load_config(None, [f"model.path={tiny_model_dir}", "rollout.env=nowhere.envs:Env"]))
    with pytest.raises(ValueError, match="rollout.env: unknown 'tools'"):
        resolve_generate_fn(load_config(None, ["rollout.env=tools"]))
    with pytest.raises(ValueError, match="not a class with reset"):
        resolve_generate_fn(load_config(None, ["rollout.env=tests.miles.envs.envs_for_tests:QUESTIONS"]))
    with pytest.raises(ConfigError, match="rollout.max_turns"):
        load_config(None, ["rollout.max_turns=0"])


def test_episodes_on_the_torch_engine_append_its_tokens_and_the_replies(ray_session, tokenizer, tiny_model_dir):
    """The same episodes on the TorchEngine: each turn's request continues the whole sequence so far, and the
    record is the engine's tokens and the quiz's questions in order, whatever the model answers."""
    controller = InferenceController(str(tiny_model_dir), 0, RolloutConfig(num_threads=1))
    by_seed = {}

    def recorded(requests):
        results = controller.generate(requests)
        by_seed.update({q.seed: (q, r) for q, r in zip(requests, results, strict=True)})
        return results

    try:
        client = GenerateClient(controller, tokenizer, _config(tiny_model_dir, "SumQuiz"), None)
        client.generate = recorded
        records = run_episodes(client, _samples(tokenizer, ["1+2=", "30+4=", "55+5=", "7+70="]))
    finally:
        controller.shutdown()

    assert any(r.num_turns > 1 for r in records)
    for k, record in enumerate(records):
        expected, mask = [], []
        for turn in range(record.num_turns):
            if turn:
                reply = _ids(tokenizer, f"{turn}+{turn}=")
                expected, mask = expected + reply, mask + [0] * len(reply)
            request, result = by_seed[turn_seed(100 + k, turn)]
            assert request.prompt_ids == record.prompt_ids + expected
            expected, mask = expected + result.output_ids, mask + [1] * len(result.output_ids)
        assert record.response_ids == expected and record.loss_mask == mask
        assert record.weight_version == 0
