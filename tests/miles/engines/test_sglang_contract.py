"""The SGLang contract: SGLangEngine against the real SGLang 0.5.23 server on this CPU and against the stand-in
(tests/miles/engines/sglang_server.py), the same tests on both.

Each test says which server behaviour it pins. The real server runs from the environment `make install-sglang-cpu`
builds (MILES_SGLANG_PYTHON names its Python; `make test` sets it); without it the real-server half is skipped.
What CPU SGLang cannot do (LoRA, seeded sampling) is tested on the stand-in alone, in test_sglang_engine.py.
The model is the embedded one with a longer context, so that a generation runs long enough to act on while it runs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from miles.config import SGLangConfig
from miles.engines.base import EngineUnavailable, GenerateRequest, GenerationProgress, SamplingParams
from miles.engines.sglang_engine import SGLangEngine, token_versions
from miles.engines.torch_engine import TorchEngine
from miles.weights.group import FLATTENED
from miles.weights.payload import serialize_bucket
from tests.helpers import SGLANG_STAND_IN, perturbed_weights, weights_directory, weights_probe
from tests.helpers.samples import ADAPTER_PROMPTS, make_requests
from tests.helpers.waiting import eventually
from tests.helpers.weight_sender import Sender, bucket_specs, in_buckets, new_group

pytestmark = pytest.mark.sglang_contract

REAL_PYTHON = os.environ.get("MILES_SGLANG_PYTHON")
LONG = 300  # tokens of a generation long enough to pause, push or probe while it runs
STAND_IN = SGLangConfig(server_module=SGLANG_STAND_IN, health_timeout_s=30)
REAL = SGLangConfig(python=REAL_PYTHON, health_timeout_s=30, startup_timeout_s=300)


@pytest.fixture(scope="session")
def contract_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """The embedded model with a 512-token context (its rotary positions need no training to go that far)."""
    directory = tmp_path_factory.mktemp("contract-model")
    for path in tiny_model_dir.iterdir():
        shutil.copy2(path, directory / path.name)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 512}))
    return directory


@pytest.fixture(scope="session")
def qwen_model_dir(contract_model_dir, tmp_path_factory) -> Path:
    """A small random Qwen2 model with the embedded tokenizer: a model class SGLang cannot read weights back from."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = tmp_path_factory.mktemp("qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy2(contract_model_dir / name, directory / name)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def _config(kind: str) -> SGLangConfig:
    if kind == "real":
        if not REAL_PYTHON:
            pytest.skip("the real SGLang server needs MILES_SGLANG_PYTHON (make install-sglang-cpu; make test sets it)")
        if not Path(REAL_PYTHON).is_file():
            pytest.fail(f"MILES_SGLANG_PYTHON={REAL_PYTHON} does not exist: run make install-sglang-cpu")
    return REAL if kind == "real" else STAND_IN


@pytest.fixture(scope="module", params=["stand-in", "real"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(kind, contract_model_dir):
    """One server of each kind for the module, at weight version 3; a test that changes its weights puts them back."""
    engine = SGLangEngine(str(contract_model_dir), weight_version=3, device="cpu", config=_config(kind), timeout_s=120)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference(contract_model_dir):
    return TorchEngine(str(contract_model_dir), weight_version=3, num_threads=1)


@pytest.fixture
def original_weights(server, contract_model_dir, tmp_path):
    """Puts the model's own weights back after the test, whatever it pushed."""
    yield
    if server.health():
        server.update_weights_from_disk(str(contract_model_dir), 3)


def _post(server, path: str, body: dict, timeout: float = 120) -> dict | list:
    response = httpx.post(f"{server.url}{path}", json=body, timeout=timeout, trust_env=False)
    response.raise_for_status()
    return response.json()


def _greedy(tokenizer, prompts=ADAPTER_PROMPTS, max_new_tokens=6, stop=None) -> list[GenerateRequest]:
    requests = make_requests(tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=0.0)
    if stop is not None:
        sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, stop_token_ids=stop)
        requests = [GenerateRequest(prompt_ids=r.prompt_ids, sampling=sampling) for r in requests]
    return requests


def _assert_same(got, expected, atol=1e-4):
    assert [(r.output_ids, r.finish_reason) for r in got] == [(r.output_ids, r.finish_reason) for r in expected]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=atol, rtol=0)


def _long_generation(server, tokenizer, count: int = 4, mode_body: dict | None = None) -> tuple[threading.Thread, list]:
    """`count` requests of LONG tokens each (EOS ignored) posted in a thread; their outputs land in the list."""
    body = {
        "input_ids": [tokenizer(p)["input_ids"] for p in ADAPTER_PROMPTS[:count]],
        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 0.0},
        "return_logprob": True,
    }
    outputs: list = []
    thread = threading.Thread(target=lambda: outputs.extend(_post(server, "/generate", body, timeout=300)))
    thread.start()
    return thread, outputs


def _generating(server) -> bool:
    """A request runs: the server refuses to flush its cache (both servers answer 400 then)."""
    return httpx.post(f"{server.url}/flush_cache", timeout=30, trust_env=False).status_code == 400


def test_greedy_samples_and_their_logprobs_equal_the_torch_engine(server, reference, tokenizer):
    """Pins: token ids in, token ids and `output_token_logprobs` out, in request order; a greedy (temperature 0)
    request's log-probs are those of the distribution at temperature 1."""
    requests = _greedy(tokenizer)
    _assert_same(server.generate(requests), reference.generate(requests))


def test_a_sequences_logprobs_equal_the_torch_engines(server, reference):
    """Pins: `input_token_logprobs` from `logprob_start_len` 0 score a given sequence (what the push check reads)."""
    token_ids = [1, 5, 9, 4, 12, 3, 7, 2, 8, 11]
    torch.testing.assert_close(
        torch.tensor(server.sequence_logprobs(token_ids)),
        torch.tensor(reference.sequence_logprobs(token_ids)),
        atol=1e-4,
        rtol=0,
    )


def test_logprobs_of_sampled_tokens_are_at_the_requests_temperature(server, contract_model_dir, tokenizer):
    """Pins: a sampled token's log-prob is under the temperature-scaled distribution, as the trainer recomputes it
    (the seeds differ between the servers, so the sampled tokens are scored by the model here)."""
    from transformers import AutoModelForCausalLM

    requests = make_requests(tokenizer, ADAPTER_PROMPTS, max_new_tokens=5, temperature=0.7)
    results = server.generate(requests)
    model = AutoModelForCausalLM.from_pretrained(contract_model_dir, dtype=torch.float32).eval()
    for request, result in zip(requests, results, strict=True):
        ids = torch.tensor([request.prompt_ids + result.output_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(request.prompt_ids) - 1 : -1] / 0.7
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(result.output_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-4, rtol=0)


def test_generation_stops_on_the_eos_of_the_models_files(server, tokenizer):
    """Pins: with no stop ids in the request, the server stops on the EOS id of generation_config.json and reports
    it as `{type: stop, matched: <id>}`; `no_stop_trim` keeps it in the output."""
    body = {
        "input_ids": [tokenizer(p)["input_ids"] for p in ADAPTER_PROMPTS],
        "sampling_params": {"max_new_tokens": 40, "temperature": 0.0, "no_stop_trim": True},
        "return_logprob": True,
    }
    outputs = _post(server, "/generate", body)
    eos = json.loads((Path(server.model_dir) / "generation_config.json").read_text())["eos_token_id"]
    stopped = [o for o in outputs if o["meta_info"]["finish_reason"]["type"] == "stop"]
    assert stopped, "the greedy model never emits its EOS within 40 tokens"
    for output in stopped:
        assert output["meta_info"]["finish_reason"]["matched"] == eos and output["output_ids"][-1] == eos
        assert eos not in output["output_ids"][:-1]


def test_a_stop_token_ends_the_sample_and_stays_in_it(server, tokenizer):
    """Pins: `stop_token_ids` stop at the first one sampled; it is the last output token (finish reason stop)."""
    every_token = tuple(range(len(tokenizer)))
    results = server.generate(_greedy(tokenizer, stop=every_token))
    assert all(r.finish_reason == "stop" and len(r.output_ids) == 1 for r in results)


def test_max_new_tokens_cuts_the_sample_with_finish_reason_length(server, tokenizer):
    """Pins: a sample that reaches max_new_tokens ends with finish reason length and exactly that many tokens."""
    results = server.generate(_greedy(tokenizer, max_new_tokens=1, stop=()))  # each answer's first digit
    assert all(r.finish_reason == "length" and len(r.output_ids) == 1 for r in results)
    assert all(len(r.logprobs) == len(r.weight_versions) == 1 for r in results)


def test_progress_counts_the_finished_requests_and_their_tokens(server, tokenizer):
    """Pins: /metrics (--enable-metrics) counts each finished request and its generated tokens, as the progress a
    long batch reports."""
    before = server.progress()
    results = server.generate(_greedy(tokenizer, max_new_tokens=3, stop=()))
    assert server.progress() - before == GenerationProgress(len(results), sum(len(r.output_ids) for r in results))


def test_a_pause_in_abort_mode_ends_the_requests_in_flight_as_aborted(server, tokenizer):
    """Pins: /pause_generation mode abort ends the running requests with finish reason abort (and the tokens made
    so far); generation goes on after /continue_generation."""
    thread, outputs = _long_generation(server, tokenizer)
    assert eventually(lambda: _generating(server), timeout_s=60), "the generation never started"
    _post(server, "/pause_generation", {"mode": "abort"})
    _post(server, "/continue_generation", {})
    thread.join(120)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outputs] == ["abort"] * 4
    assert all(len(o["output_ids"]) < LONG for o in outputs)
    assert all(r.finish_reason == "length" for r in server.generate(_greedy(tokenizer, max_new_tokens=1, stop=())))


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_paused_generation_waits_and_continues_whole(server, tokenizer, mode):
    """Pins: in modes retract and in_place the running requests wait out the pause and then finish with every token
    (retract recomputes their KV cache, in_place keeps it); a greedy sample is the same as an unpaused one."""
    unpaused, reference = _long_generation(server, tokenizer, count=2)
    unpaused.join(120)
    thread, outputs = _long_generation(server, tokenizer, count=2)
    assert eventually(lambda: _generating(server), timeout_s=60), "the generation never started"
    _post(server, "/pause_generation", {"mode": mode})
    assert not _health_generate(server, timeout=3)  # a paused server cannot run its probe
    _post(server, "/continue_generation", {})
    thread.join(120)
    assert [o["meta_info"]["finish_reason"]["type"] for o in outputs] == ["length"] * 2
    assert [o["output_ids"] for o in outputs] == [o["output_ids"] for o in reference]


def _health_generate(server, timeout: float) -> bool:
    try:
        return httpx.get(f"{server.url}/health_generate", timeout=timeout, trust_env=False).status_code == 200
    except httpx.TimeoutException:
        return False


def test_a_busy_server_is_healthy(server, tokenizer):
    """Pins: /health_generate answers 200 while a long batch runs (the probe counts any output as life), so the
    controller's health sweep after a failure leaves a busy server alone."""
    thread, outputs = _long_generation(server, tokenizer)
    assert eventually(lambda: _generating(server), timeout_s=60), "the generation never started"
    assert server.health()
    thread.join(120)
    assert len(outputs) == 4 and all(len(o["output_ids"]) == LONG for o in outputs)


def test_a_generation_longer_than_the_timeout_is_waited_for_while_the_server_is_healthy(server, tokenizer):
    """Pins: a busy server passes its health check, so a batch that outlasts `timeout_s` is waited for, not taken for
    a hang (the timeout is set to a quarter of what this batch took unpaused)."""
    body = {
        "input_ids": [tokenizer(p)["input_ids"] for p in ADAPTER_PROMPTS[:4]],
        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 0.0},
    }
    started = time.perf_counter()
    unhurried = server._post_while_healthy("/generate", body).json()
    took = time.perf_counter() - started
    checks = server._log_path.read_text().count("GET /health_generate")
    timeout_s = server.timeout_s
    server.timeout_s = took / 4
    try:
        hurried = server._post_while_healthy("/generate", body).json()
    finally:
        server.timeout_s = timeout_s
    assert [o["output_ids"] for o in hurried] == [o["output_ids"] for o in unhurried]
    assert server._log_path.read_text().count("GET /health_generate") > checks  # it waited past the timeout


def test_a_disk_push_serves_the_new_weights_with_no_stale_prefix_cache(
    server, reference, contract_model_dir, tokenizer, tmp_path, original_weights
):
    """Pins: /update_weights_from_disk inside pause / begin / end / continue loads the directory; the prefix (radix)
    cache built on the old weights is flushed, so a prompt served before the push is computed anew after it."""
    requests = _greedy(tokenizer)
    server.generate(requests)  # the prompts are now in the prefix cache
    weights = perturbed_weights(contract_model_dir, 1, 0.05)
    server.update_weights_from_disk(str(weights_directory(contract_model_dir, weights, tmp_path / "4")), 4)
    assert server.weight_version() == 4
    body = {"input_ids": requests[0].prompt_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    first, second = (_post(server, "/generate", body)["meta_info"]["cached_tokens"] for _ in range(2))
    assert first == 0 and second > 0  # flushed by the push, and caching again
    after = server.generate(requests)
    twin = TorchEngine(str(contract_model_dir), weight_version=4, num_threads=1)
    twin.update_weights(weights, 4)
    _assert_same(after, twin.generate(requests))
    assert {v for r in after for v in r.weight_versions} == {4}


def test_a_distributed_push_lands_bucket_by_bucket(server, contract_model_dir, tokenizer, original_weights):
    """Pins: /init_weights_update_group joins a gloo group at the rank offset, and each
    /update_weights_from_distributed bucket (flattened, as SGLang recommends) loads into the served weights."""
    weights = perturbed_weights(contract_model_dir, 2, 0.05)
    buckets = in_buckets(weights, 3)
    group = new_group()
    sender = Sender(group)
    try:
        sender.send(buckets, FLATTENED)
        server.update_weights_from_distributed(group, 1, bucket_specs(buckets), 5, FLATTENED)
        sender.wait()
    finally:
        sender.close()
    requests = _greedy(tokenizer)
    twin = TorchEngine(str(contract_model_dir), weight_version=5, num_threads=1)
    twin.update_weights(weights, 5)
    _assert_same(server.generate(requests), twin.generate(requests))


def test_a_tensor_push_lands_bucket_by_bucket(server, contract_model_dir, tokenizer, original_weights):
    """Pins: /update_weights_from_tensor inside the refit session loads each bucket's payload, of load_format
    flattened_bucket (one uint8 tensor and a record per tensor, which SGLang's SafeUnpickler admits; a CPU tensor goes
    as its bytes), its byte ranges aligned for SGLang's views of them. A push in parts holds one session from its
    first part to its last; one stopped part way is ended (SGLang refuses a second begin_weight_update), whether
    closed or met by the next push, and generation goes on."""
    served = server.weight_version()
    generate = {"input_ids": _greedy(tokenizer)[0].prompt_ids, "sampling_params": {"max_new_tokens": 2}}
    stopped = [serialize_bucket(b)[0] for b in in_buckets(perturbed_weights(contract_model_dir, 4, 0.05), 3)]
    server.update_weights_from_tensor(stopped[:1], 6, last=False)
    server.close_weight_update()
    assert server.weight_version() == served
    _post(server, "/generate", generate, timeout=60)  # a session left open would hold the request paused
    server.update_weights_from_tensor(stopped[:1], 6, last=False)  # stopped again, and not closed
    weights = perturbed_weights(contract_model_dir, 5, 0.05)
    buckets = [serialize_bucket(b)[0] for b in in_buckets(weights, 3)]
    for index, bucket in enumerate(buckets):
        server.update_weights_from_tensor([bucket], 7, last=index == len(buckets) - 1)
        assert server.weight_version() == (7 if index == len(buckets) - 1 else served)
    requests = _greedy(tokenizer)
    twin = TorchEngine(str(contract_model_dir), weight_version=7, num_threads=1)
    twin.update_weights(weights, 7)
    _assert_same(server.generate(requests), twin.generate(requests))


def test_memory_released_for_a_train_step_comes_back_with_the_push(
    server, contract_model_dir, tokenizer, original_weights
):
    """Pins: an engine whose memory is released serves nothing until resumed, and weights resumed and pushed, then the
    KV cache, serve the pushed weights. On a CPU the server is asked nothing: SGLang 0.5.23's release ends in
    torch.cuda.synchronize, which kills its scheduler where there is no GPU (the endpoints' bodies are checked
    against SGLang's request classes in test_sglang_rules.py, and the stand-in's drop of the weights in the simulated
    GPU runs of test_placement.py)."""
    requests = _greedy(tokenizer)
    server.generate(requests)  # the prompts are now in the prefix cache
    server.release_memory(["kv_cache", "weights"])
    with pytest.raises(RuntimeError, match=r"released its \['kv_cache', 'weights'\] memory"):
        server.generate(requests)
    server.resume_memory(["weights"])
    weights = perturbed_weights(contract_model_dir, 6, 0.05)
    server.update_weights_from_tensor([serialize_bucket(b)[0] for b in in_buckets(weights, 2)], 8)
    server.resume_memory(["kv_cache"])
    assert server.health()
    twin = TorchEngine(str(contract_model_dir), weight_version=8, num_threads=1)
    twin.update_weights(weights, 8)
    _assert_same(server.generate(requests), twin.generate(requests))


def test_a_push_in_the_middle_of_a_generation_is_recorded_per_token(
    server, contract_model_dir, tokenizer, tmp_path, original_weights
):
    """Pins: a push while requests run pauses them (retract), loads, and continues them on the new weights; each
    output's `weight_versions` spans say which tokens came from which version."""
    pushed = weights_directory(contract_model_dir, perturbed_weights(contract_model_dir, 3, 0.05), tmp_path / "6")
    started = time.monotonic()
    unpushed, _ = _long_generation(server, tokenizer)
    unpushed.join(120)
    whole_generation_s = time.monotonic() - started
    thread, outputs = _long_generation(server, tokenizer)
    assert eventually(lambda: _generating(server), timeout_s=60), "the generation never started"
    # A request counts as running from its arrival, before its first token: push a third of the way in.
    time.sleep(whole_generation_s / 3)
    server.update_weights_from_disk(str(pushed), 6)
    thread.join(120)
    versions = [token_versions(o["meta_info"], len(o["output_ids"])) for o in outputs]
    assert all(len(v) == LONG for v in versions)
    assert all(v == sorted(v) and v[-1] == 6 for v in versions)
    assert any(v[0] == 3 for v in versions)  # the push came after the first tokens


def test_a_dead_server_is_unavailable_and_a_new_one_serves_the_same(kind, contract_model_dir, reference, tokenizer):
    """Pins: a killed server refuses connections: generate raises EngineUnavailable naming its exit, health is
    False; a server started anew (as the controller restarts one) serves the model's samples."""
    config = _config(kind)
    engine = SGLangEngine(str(contract_model_dir), weight_version=3, device="cpu", config=config, timeout_s=60)
    requests = _greedy(tokenizer)
    try:
        os.killpg(engine._process.pid, signal.SIGKILL)
        engine._process.wait()
        with pytest.raises(EngineUnavailable, match="exited with code -9"):
            engine.generate(requests)
        assert not engine.health()
    finally:
        engine.shutdown()
    restarted = SGLangEngine(str(contract_model_dir), weight_version=3, device="cpu", config=config, timeout_s=60)
    try:
        _assert_same(restarted.generate(requests), reference.generate(requests))
    finally:
        restarted.shutdown()


def test_a_push_to_a_model_sglang_cannot_read_back_is_checked_by_its_logprobs(kind, qwen_model_dir, tmp_path):
    """Pins: SGLang's Qwen2 has no /get_weights_by_name (400), so a push is checked by the served log-probs of the
    probe sequence against the trainer's: the right weights pass, weights under names the model lacks (skipped by
    the load, which still succeeds) fail."""
    engine = SGLangEngine(str(qwen_model_dir), weight_version=0, device="cpu", config=_config(kind), timeout_s=60)
    try:
        name = "model.layers.0.self_attn.q_proj.weight"
        answer = httpx.post(f"{engine.url}/get_weights_by_name", json={"name": name}, timeout=30, trust_env=False)
        weights = perturbed_weights(qwen_model_dir, 4, 0.1)
        probe = weights_probe(qwen_model_dir, weights)
        prefixed = {f"module.{k}": v for k, v in weights.items()}
        engine.update_weights_from_disk(str(weights_directory(qwen_model_dir, prefixed, tmp_path / "bad")), 1)
        with pytest.raises(ValueError, match="reported weights version 1 loaded, but does not serve them"):
            probe.check(engine.sequence_logprobs(probe.token_ids), "engine 0", 1)
        engine.update_weights_from_disk(str(weights_directory(qwen_model_dir, weights, tmp_path / "good")), 1)
        probe.check(engine.sequence_logprobs(probe.token_ids), "engine 0", 1)
    finally:
        engine.shutdown()
    if kind == "real":
        assert answer.status_code == 400
