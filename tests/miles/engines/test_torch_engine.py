import json
import shutil

import pytest
import torch
from transformers import AutoTokenizer

from miles.engines import RolloutEngine
from miles.engines.base import eos_token_ids
from miles.engines.torch_engine import TorchEngine
from miles.run_dir import RunDir
from miles.train.actor import TrainActor
from miles.train.batch import batch_from_table
from miles.train.update import batch_logprobs
from tests.helpers.samples import make_requests, seeded, training_table


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
    assert isinstance(engine, RolloutEngine)
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
