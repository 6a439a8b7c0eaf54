import dataclasses
import json
import shutil
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

from miles.engines.base import eos_token_ids
from miles.engines.torch_engine import TorchEngine
from miles.state.run_dir import RunDir
from miles.train.actor import TrainActor
from miles.train.batch import batch_from_table
from miles.train.update import batch_logprobs
from tests.helpers import perturbed_weights
from tests.helpers.engine_contract import contract_violations
from tests.helpers.samples import make_requests, seeded, training_table
from tests.helpers.waiting import eventually


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return TorchEngine(str(tiny_model_dir), weight_version=3, num_threads=1)


def test_engine_logprobs_equal_trainer_logprobs(engine, tokenizer, tiny_model_dir, small_config):
    prompts = ["1+2=", "45+67=", "9+99=", "10+0=", "3+14="] * 4
    requests = make_requests(tokenizer, prompts)
    results = engine.generate(seeded(requests, 7))
    config = small_config()
    RunDir(config.run_dir).create()
    trainer = TrainActor(config, str(tiny_model_dir))
    batch = batch_from_table(training_table(requests, results), trainer.pad_token_id)
    trainer_lp = batch_logprobs(trainer.model, batch, trainer.config, trainer.device)
    mask = batch.response_mask
    assert mask.sum() == sum(len(r.output_ids) for r in results)
    assert torch.allclose(trainer_lp[mask], batch.rollout_logprobs[mask], atol=1e-5)
    assert all(lp <= 0.0 for r in results for lp in r.logprobs)


def test_torch_engine_implements_the_engine_protocol(engine):
    assert contract_violations(type(engine)) == []
    assert engine.health() and engine.weight_version() == 3


def test_generation_is_reproducible_per_seed_and_reports_version(engine, tokenizer):
    requests = make_requests(tokenizer, ["12+34=", "5+5="] * 8)
    first = engine.generate(seeded(requests, 1))
    again = engine.generate(seeded(requests, 1))
    other = engine.generate(seeded(requests, 2))
    assert [r.output_ids for r in first] == [r.output_ids for r in again]
    assert [r.output_ids for r in first] != [r.output_ids for r in other]
    assert {r.weight_version for r in first} == {3}


def test_stop_and_length_finish_reasons(engine, tokenizer):
    eos = tokenizer.eos_token_id
    results = engine.generate(seeded(make_requests(tokenizer, ["1+1="] * 32, max_new_tokens=2), 0))
    for r in results:
        assert 1 <= len(r.output_ids) <= 2
        if r.finish_reason == "stop":
            assert r.output_ids[-1] == eos
        else:
            assert r.finish_reason == "length" and len(r.output_ids) == 2 and eos not in r.output_ids


def test_top_p_keeps_only_the_most_likely_token_when_tiny(engine, tokenizer):
    greedy_like = engine.generate(seeded(make_requests(tokenizer, ["23+45="] * 8, top_p=1e-6), 3))
    assert len({tuple(r.output_ids) for r in greedy_like}) == 1


def test_temperature_zero_decodes_greedily_as_transformers_does(engine, tokenizer, tiny_model_dir):
    """Greedy beside sampled requests in one batch, whatever their seeds: the argmax tokens of plain transformers,
    log-probs at temperature 1 (as SGLang reports them for a greedy request)."""
    from transformers import AutoModelForCausalLM

    prompts = ["12+30=", "7+8=", "45+67=", "3+14="]
    greedy = make_requests(tokenizer, prompts, temperature=0.0)
    sampled = make_requests(tokenizer, prompts)
    results = engine.generate(seeded(greedy + sampled, 5))
    again = engine.generate(seeded(greedy, 11))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for request, result, other in zip(greedy, results, again, strict=False):
        out = model.generate(
            torch.tensor([request.prompt_ids]),
            attention_mask=torch.ones(1, len(request.prompt_ids), dtype=torch.long),
            max_new_tokens=request.sampling.max_new_tokens,
            do_sample=False,
            eos_token_id=list(request.sampling.stop_token_ids),
            pad_token_id=tokenizer.pad_token_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        expected = out.sequences[0, len(request.prompt_ids) :].tolist()
        assert result.output_ids == other.output_ids == expected
        expected_logprobs = [torch.log_softmax(s[0], -1)[t].item() for s, t in zip(out.scores, expected, strict=True)]
        assert result.logprobs == pytest.approx(expected_logprobs, abs=1e-4)


def test_update_weights_changes_outputs_and_version(tiny_model_dir, tokenizer):
    engine = TorchEngine(str(tiny_model_dir), num_threads=1)
    requests = make_requests(tokenizer, ["7+8="] * 4)
    before = engine.generate(seeded(requests, 0))
    weights = {k: torch.zeros_like(v) for k, v in engine.model.state_dict().items()}
    engine.update_weights(weights, version=5)
    after = engine.generate(seeded(requests, 0))
    assert engine.weight_version() == 5 and {r.weight_version for r in after} == {5}
    # All-zero weights give uniform logits: every token has log-prob -log(vocab).
    vocab = engine.model.config.vocab_size
    assert all(abs(lp + torch.log(torch.tensor(float(vocab))).item()) < 1e-5 for r in after for lp in r.logprobs)
    assert [r.logprobs for r in before] != [r.logprobs for r in after]


def test_every_eos_id_of_the_model_files_is_a_stop_id(tiny_model_dir, tmp_path):
    """As SGLang stops: the tokenizer's EOS, then config.json's and generation_config.json's (an id or a list)."""
    for path in tiny_model_dir.iterdir():
        shutil.copy2(path, tmp_path / path.name)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    (tmp_path / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, 7, 5]}))
    assert eos_token_ids(AutoTokenizer.from_pretrained(tiny_model_dir)) == (2,)
    assert eos_token_ids(AutoTokenizer.from_pretrained(tmp_path)) == (2, 7, 5)


# --- continuous batching and pushes in the middle of a generation ------------------------------------------------


def _counting_steps(engine, monkeypatch, delay_s: float = 0.0) -> list[int]:
    """Count the engine's decode steps (each one optionally slowed by `delay_s`)."""
    steps: list[int] = []
    step = engine._step

    def counted(admitted):
        steps.append(len(admitted))
        time.sleep(delay_s)
        step(admitted)

    monkeypatch.setattr(engine, "_step", counted)
    return steps


def test_continuous_batching_samples_what_static_batching_does(tiny_model_dir, tokenizer):
    """Per-request seeds: the same tokens whether every request runs in one batch, three at a time with freed
    slots refilled, or alone."""
    requests = seeded(make_requests(tokenizer, ["1+2=", "45+67=", "9+99=", "10+0=", "3+14="] * 4, max_new_tokens=8), 3)
    static = TorchEngine(str(tiny_model_dir), num_threads=1).generate(requests)
    slots = TorchEngine(str(tiny_model_dir), num_threads=1, max_running_requests=3)
    continuous = slots.generate(requests)
    alone = [slots.generate([r])[0] for r in requests[:5]]
    assert len({len(r.output_ids) for r in static}) > 1  # lengths differ: rows leave and join mid-batch
    for expected, got in [*zip(static, continuous, strict=True), *zip(static, alone, strict=False)]:
        assert got.output_ids == expected.output_ids and got.finish_reason == expected.finish_reason
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-5)


def test_a_finished_row_is_refilled_at_the_next_step(tiny_model_dir, tokenizer, monkeypatch):
    engine = TorchEngine(str(tiny_model_dir), num_threads=1, max_running_requests=2)
    lengths = [1, 8, 1, 1, 1, 1]
    requests = [
        dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=n, stop_token_ids=()))
        for r, n in zip(seeded(make_requests(tokenizer, ["1+2="] * len(lengths)), 1), lengths, strict=True)
    ]
    steps = _counting_steps(engine, monkeypatch)
    results = engine.generate(requests)
    assert [len(r.output_ids) for r in results] == lengths
    # The long request decodes alone in its slot while the short ones take turns in the other: 8 steps, not the
    # 10 of waves of two (8 + 1 + 1); one request joins at each of the first steps.
    assert steps == [2, 1, 1, 1, 1, 0, 0, 0]


def _long_requests(tokenizer, count: int, tokens: int = 12):
    """Requests that all run to `tokens` tokens (no stop ids), so a generation's length is known."""
    return [
        dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=tokens, stop_token_ids=()))
        for r in seeded(make_requests(tokenizer, ["12+34=", "5+6=", "70+8="] * (count // 3)), 2)
    ]


def _push_midway(engine, monkeypatch, requests, push) -> list:
    """Generate `requests` (each decode step slowed), calling `push()` once about a third of the steps are done."""
    steps = _counting_steps(engine, monkeypatch, delay_s=0.01)
    results: list = []
    thread = threading.Thread(target=lambda: results.extend(engine.generate(requests)))
    thread.start()
    # Of 36 steps, three waves of 12 tokens: the push comes once the second wave is under way.
    assert eventually(lambda: len(steps) >= 14, every_s=0.001), "the first wave never finished"
    push()
    thread.join(60)
    return results


def _versions_switch_once(results, old: int, new: int) -> list[int]:
    """Each sample's versions are `old` up to some token and `new` after; returns where each switches."""
    switches = []
    for r in results:
        k = r.weight_versions.count(old)
        assert r.weight_versions == [old] * k + [new] * (len(r.weight_versions) - k)
        switches.append(k)
    return switches


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_push_mid_generation_changes_the_versions_at_the_push_and_loses_no_token(
    tiny_model_dir, tokenizer, monkeypatch, mode
):
    """The same weights pushed as version 1 in the middle: every sample is the one an uninterrupted generation
    gives (no token lost or repeated), and its tokens are version 0 up to the push and 1 after it."""
    requests = _long_requests(tokenizer, 12)
    expected = TorchEngine(str(tiny_model_dir), num_threads=1).generate(requests)
    engine = TorchEngine(str(tiny_model_dir), num_threads=1, max_running_requests=4, pause_generation_mode=mode)
    same = {k: v.clone() for k, v in engine.model.state_dict().items()}
    results = _push_midway(engine, monkeypatch, requests, lambda: engine.update_weights(same, version=1))
    for got, want in zip(results, expected, strict=True):
        assert got.output_ids == want.output_ids and len(got.output_ids) == 12
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)  # a recomputed cache sums in another order
    switches = _versions_switch_once(results, old=0, new=1)
    assert 0 in switches and 12 in switches  # requests that started after the push, and ones done before it
    assert any(0 < k < 12 for k in switches)  # and ones it caught in flight


def test_after_a_retract_every_token_comes_from_the_new_weights(tiny_model_dir, tokenizer, monkeypatch):
    """Retract recomputes the KV cache of the requests in flight: after the switch, each token's log-prob is the new
    model's on the sample's own prefix; before it, the sample is what the old weights gave."""
    from transformers import AutoModelForCausalLM

    requests = _long_requests(tokenizer, 12)
    old = TorchEngine(str(tiny_model_dir), num_threads=1).generate(requests)
    engine = TorchEngine(str(tiny_model_dir), num_threads=1, max_running_requests=4, pause_generation_mode="retract")
    weights = perturbed_weights(tiny_model_dir, 1, 0.05)
    results = _push_midway(engine, monkeypatch, requests, lambda: engine.update_weights(weights, version=1))
    new_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new_model.load_state_dict(weights)
    switches = _versions_switch_once(results, old=0, new=1)
    assert any(0 < k < 12 for k in switches)
    for request, result, before, k in zip(requests, results, old, switches, strict=True):
        assert result.output_ids[:k] == before.output_ids[:k]
        assert result.logprobs[:k] == pytest.approx(before.logprobs[:k], abs=1e-5)
        with torch.no_grad():
            ids = torch.tensor([request.prompt_ids + result.output_ids])
            logprobs = torch.log_softmax(new_model(ids).logits[0, len(request.prompt_ids) - 1 : -1], dim=-1)
        teacher_forced = logprobs.gather(1, torch.tensor(result.output_ids)[:, None]).squeeze(1).tolist()
        assert result.logprobs[k:] == pytest.approx(teacher_forced[k:], abs=1e-4)


def test_a_pause_in_abort_mode_ends_the_requests_in_flight(tiny_model_dir, tokenizer, monkeypatch):
    engine = TorchEngine(str(tiny_model_dir), num_threads=1, max_running_requests=4)
    requests = _long_requests(tokenizer, 12)

    def abort():
        engine.pause_generation("abort")
        engine.continue_generation()

    results = _push_midway(engine, monkeypatch, requests, abort)
    reasons = [r.finish_reason for r in results]
    assert "abort" in reasons and "length" in reasons  # those done before the pause keep their end
    assert all(len(r.output_ids) < 12 for r in results if r.finish_reason == "abort")
    assert engine.generate(requests[:2])[0].finish_reason == "length"  # and the engine serves again
