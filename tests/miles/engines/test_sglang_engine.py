"""SGLangEngine against the stand-in SGLang server (tests/miles/engines/sglang_server.py), in this process.

The stand-in generates with a TorchEngine, so every sample must equal a TorchEngine's holding the same weights:
that checks the request fields, the reading of `output_token_logprobs` and the weight and adapter pushes at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import threading

import httpx
import pytest
import ray
import torch
from safetensors.torch import save_file

from miles.config import SGLangConfig, load_config
from miles.engines import sglang_engine
from miles.engines.base import EngineUnavailable, GenerateRequest, SamplingParams
from miles.engines.sglang_engine import SGLangEngine, choose_attention_backend, token_versions
from miles.engines.torch_engine import TorchEngine
from miles.weights.group import FLATTENED
from tasks.retries import NOT_RETRIED
from tests.helpers import GPU_ATTENTION_BACKEND, SGLANG_STAND_IN, perturbed_weights, weights_directory, weights_probe
from tests.helpers.engine_contract import contract_violations
from tests.helpers.faults import sglang_server_pid
from tests.helpers.samples import ADAPTER_PROMPTS, make_requests, seeded, with_adapter
from tests.helpers.waiting import eventually
from tests.helpers.weight_sender import Sender, bucket_specs, in_buckets, new_group

# The stand-in plays a GPU server here: its attention backend allows seeded sampling, which these tests compare.
STAND_IN = SGLangConfig(server_module=SGLANG_STAND_IN, health_timeout_s=5, attention_backend=GPU_ATTENTION_BACKEND)


def _start(tiny_model_dir, **kwargs) -> SGLangEngine:
    kwargs.setdefault("config", STAND_IN)
    return SGLangEngine(str(tiny_model_dir), device="cpu", **kwargs)


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir):
    """One server for the module, with LoRA enabled as the multi-LoRA flow starts it."""
    engine = _start(
        tiny_model_dir,
        weight_version=3,
        lora_rank=8,
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(tiny_model_dir):
    engine = _start(tiny_model_dir, weight_version=3, timeout_s=5)
    yield engine
    engine.shutdown()


def _requests_log(engine) -> list[str]:
    """The server's access log: 'POST /generate', ... in the order the server got them."""
    return re.findall(r'"((?:GET|POST) /\w+)', engine._log_path.read_text())


def _assert_same(got, expected):
    assert [(r.output_ids, r.finish_reason, r.weight_version) for r in got] == [
        (r.output_ids, r.finish_reason, r.weight_version) for r in expected
    ]
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-5, rtol=0)


def test_samples_equal_the_torch_engine(lora_engine, tiny_model_dir, tokenizer):
    assert contract_violations(type(lora_engine)) == []
    requests = make_requests(tokenizer, ADAPTER_PROMPTS * 3, max_new_tokens=2, temperature=0.9, top_p=0.95)
    # Every token stops the last six: "stop" is read whatever this test model samples; the rest may run to "length".
    any_token = tuple(range(len(tokenizer)))
    requests[-6:] = [
        dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, stop_token_ids=any_token))
        for r in requests[-6:]
    ]
    requests = seeded(requests, 7)
    reference = TorchEngine(str(tiny_model_dir), weight_version=3, num_threads=1)

    results = lora_engine.generate(requests)

    _assert_same(results, reference.generate(requests))
    assert {r.finish_reason for r in results} == {"stop", "length"}  # both forms of finish_reason are read
    for request, result in zip(requests, results, strict=True):
        if result.finish_reason == "stop":  # no_stop_trim: the stop token is kept
            assert result.output_ids[-1] in request.sampling.stop_token_ids


def test_a_weight_push_runs_the_refit_session_and_changes_the_samples(engine, tiny_model_dir, tokenizer, tmp_path):
    weights = perturbed_weights(tiny_model_dir, 1, 0.05)
    requests = seeded(make_requests(tokenizer, ADAPTER_PROMPTS, max_new_tokens=6), 3)
    reference = TorchEngine(str(tiny_model_dir), weight_version=3, num_threads=1)
    before = engine.generate(requests)

    engine.update_weights_from_disk(str(weights_directory(tiny_model_dir, weights, tmp_path / "4")), 4)

    reference.update_weights(weights, 4)
    after = engine.generate(requests)
    _assert_same(after, reference.generate(requests))
    assert {r.weight_version for r in before} == {3} and {r.weight_version for r in after} == {4}  # read from meta_info
    assert [r.output_ids for r in after] != [r.output_ids for r in before]
    log = _requests_log(engine)
    refit = log[log.index("POST /pause_generation") :]
    assert refit[:5] == [
        "POST /pause_generation",
        "POST /begin_weight_update",
        "POST /update_weights_from_disk",
        "POST /end_weight_update",
        "POST /continue_generation",
    ]
    assert "GET /health_generate" not in refit[: refit.index("POST /continue_generation")]  # it would answer 503


def test_a_push_the_server_skips_is_told_by_the_push_check(engine, tiny_model_dir, tmp_path):
    """SGLang skips tensor names it does not know and still reports success: a wrong prefix would keep every old
    weight. The engine's log-probs of the probe sequence, against the trainer's, tell."""
    weights = perturbed_weights(tiny_model_dir, 2, 0.05)
    prefixed = weights_directory(tiny_model_dir, {f"module.{k}": v for k, v in weights.items()}, tmp_path / "bad")
    probe = weights_probe(tiny_model_dir, weights)
    engine.update_weights_from_disk(str(prefixed), 4)
    with pytest.raises(ValueError, match=r"engine 0 reported weights version 4 loaded, but does not serve them"):
        probe.check(engine.sequence_logprobs(probe.token_ids), "engine 0", 4)
    engine.update_weights_from_disk(str(weights_directory(tiny_model_dir, weights, tmp_path / "good")), 4)
    probe.check(engine.sequence_logprobs(probe.token_ids), "engine 0", 4)  # the right names pass the same check


def test_a_distributed_push_joins_the_group_once_and_lands_bucket_by_bucket(engine, tiny_model_dir, tokenizer):
    """The server joins the weight-update group on the first push only; each bucket is one
    /update_weights_from_distributed inside the refit session."""
    requests = seeded(make_requests(tokenizer, ADAPTER_PROMPTS, max_new_tokens=6), 3)
    reference = TorchEngine(str(tiny_model_dir), weight_version=3, num_threads=1)
    group = new_group()
    sender = Sender(group)
    try:
        for version, load_format in ((4, FLATTENED), (5, None)):  # SGLang's two formats of a bucket
            weights = perturbed_weights(tiny_model_dir, version, 0.05)
            buckets = in_buckets(weights, 3)
            sender.send(buckets, load_format)
            engine.update_weights_from_distributed(group, 1, bucket_specs(buckets), version, load_format)
            sender.wait()
            reference.update_weights(weights, version)
            _assert_same(engine.generate(requests), reference.generate(requests))
    finally:
        sender.close()
    log = _requests_log(engine)
    assert log.count("POST /init_weights_update_group") == 1
    refit = log[log.index("POST /pause_generation") :]
    assert refit[:7] == [
        "POST /pause_generation",
        "POST /begin_weight_update",
        *["POST /update_weights_from_distributed"] * 3,
        "POST /end_weight_update",
        "POST /continue_generation",
    ]
    assert "GET /health_generate" not in refit[: refit.index("POST /continue_generation")]


def test_a_pause_in_abort_mode_aborts_the_running_batch(engine, tokenizer):
    """As SGLang's /pause_generation (mode abort): the requests running then end with finish reason abort, which
    the engine reports as an error (its refits pause without aborting, so an abort is the server's failure)."""
    httpx.post(f"{engine.url}/test_fault", json={"generate_delay_s": 2.0}, trust_env=False).raise_for_status()
    requests = make_requests(tokenizer, ADAPTER_PROMPTS, max_new_tokens=4)
    outcome: list[BaseException] = []

    def generate():
        try:
            engine.generate(requests)
        except BaseException as exc:  # noqa: BLE001 - read below
            outcome.append(exc)

    thread = threading.Thread(target=generate)
    thread.start()
    assert eventually(lambda: _running(engine)), "the batch never started"
    httpx.post(f"{engine.url}/pause_generation", json={"mode": "abort"}, trust_env=False).raise_for_status()
    httpx.post(f"{engine.url}/continue_generation", json={}, trust_env=False).raise_for_status()
    thread.join(30)
    assert len(outcome) == 1 and isinstance(outcome[0], RuntimeError)
    assert f"aborted {len(requests)} of {len(requests)} requests: Abort in running batch." in str(outcome[0])


def test_the_server_stops_on_the_models_eos_whatever_the_request_asks(engine, tiny_model_dir, tokenizer):
    prompts = ["1+2=", "45+67=", "3+4="]
    body = {
        "input_ids": [tokenizer(p)["input_ids"] for p in prompts],
        "sampling_params": [{"max_new_tokens": 12, "stop_token_ids": [], "sampling_seed": i} for i in range(3)],
    }
    outputs = httpx.post(f"{engine.url}/generate", json=body, trust_env=False).json()
    unstopped = TorchEngine(str(tiny_model_dir), num_threads=1).generate(
        [
            GenerateRequest(prompt_ids=ids, sampling=SamplingParams(max_new_tokens=12), seed=i)
            for i, ids in enumerate(body["input_ids"])
        ]
    )
    eos = tokenizer.eos_token_id
    assert any(eos in r.output_ids[:-1] for r in unstopped)  # without the EOS stop these samples run past it
    for output, free in zip(outputs, unstopped, strict=True):
        if eos in free.output_ids:
            assert output["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
            assert output["output_ids"] == free.output_ids[: free.output_ids.index(eos)]  # stop token trimmed


def test_null_logprobs_are_a_retried_error_naming_the_request(engine, tokenizer):
    """A sample without its log-probs cannot be trained on; it is the server's failure, so the task retries it
    (a ValueError would say the config is wrong, and is not retried)."""
    httpx.post(f"{engine.url}/test_fault", json={"null_logprobs": True}, trust_env=False).raise_for_status()
    requests = seeded(make_requests(tokenizer, ADAPTER_PROMPTS, max_new_tokens=3), 5)
    with pytest.raises(
        RuntimeError, match=r"null log-probs for request 0 of the batch \(seed 50000, \d+ prompt tokens\)"
    ) as raised:
        engine.generate(requests)
    assert not isinstance(raised.value, NOT_RETRIED)


def test_adapters_are_loaded_replaced_and_unloaded(lora_engine, tiny_model_dir, tokenizer, make_lora):
    first, second = make_lora(1), make_lora(2)
    requests = seeded(make_requests(tokenizer, ADAPTER_PROMPTS, max_new_tokens=6), 9)
    mixed = requests + with_adapter(requests, "a")
    reference = TorchEngine(str(tiny_model_dir), weight_version=3, num_threads=1)

    lora_engine.load_adapter("a", *first, version=1)
    reference.load_adapter("a", *first, version=1)
    _assert_same(lora_engine.generate(mixed), reference.generate(mixed))

    lora_engine.load_adapter("a", *second, version=2)  # a name loads once: the new version unloads the old first
    reference.load_adapter("a", *second, version=2)
    results = lora_engine.generate(mixed)
    _assert_same(results, reference.generate(mixed))
    assert {r.weight_version for r in results[len(requests) :]} == {2} and {
        r.weight_version for r in results[: len(requests)]
    } == {3}
    log = _requests_log(lora_engine)
    assert (
        log.count("POST /load_lora_adapter") == 2
        and log[log.index("POST /unload_lora_adapter") + 1] == "POST /load_lora_adapter"
    )

    with pytest.raises(ValueError, match="frozen"):
        lora_engine.update_weights_from_disk(str(tiny_model_dir), 5)
    lora_engine.unload_adapter("a")
    assert lora_engine.adapter_versions() == {}
    with pytest.raises(ValueError, match="not loaded"):
        lora_engine.generate(with_adapter(requests, "a"))


def test_the_server_refuses_a_name_loaded_twice(lora_engine, make_lora, tmp_path):
    tensors, config = make_lora(3)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps(config))
    body = {"lora_name": "twice", "lora_path": str(tmp_path), "pinned": False}
    assert httpx.post(f"{lora_engine.url}/load_lora_adapter", json=body, trust_env=False).json()["success"]
    answer = httpx.post(f"{lora_engine.url}/load_lora_adapter", json=body, trust_env=False)
    assert answer.status_code == 400
    assert answer.json()["error_message"] == "Failed to load LoRA adapter twice because it is already loaded"
    httpx.post(
        f"{lora_engine.url}/unload_lora_adapter", json={"lora_name": "twice"}, trust_env=False
    ).raise_for_status()


def test_a_refused_request_is_a_value_error(engine):
    with pytest.raises(ValueError, match="refused /unload_lora_adapter .*does not exist"):
        engine._post("/unload_lora_adapter", {"lora_name": "nothing"})
    assert engine.health()


@pytest.mark.parametrize("fault", ["connection refused", "5xx", "timeout"])
def test_a_dead_failing_or_silent_server_raises_engine_unavailable(engine, tokenizer, fault, monkeypatch):
    requests = make_requests(tokenizer, ADAPTER_PROMPTS, max_new_tokens=4)
    posted: list[str] = []
    post = engine._http.post

    def counted_post(path, **kwargs):
        posted.append(path)
        return post(path, **kwargs)

    monkeypatch.setattr(engine._http, "post", counted_post)
    pid = engine._process.pid
    if fault == "connection refused":
        os.killpg(pid, signal.SIGKILL)
        engine._process.wait()
        expected = "exited with code -9"
    elif fault == "5xx":
        httpx.post(f"{engine.url}/test_fault", json={"status": 503}, trust_env=False).raise_for_status()
        expected = "answered 503"
    else:
        os.killpg(pid, signal.SIGSTOP)  # alive, but silent: the 5 s timeout of the engine fixture ends the wait
        expected = "no answer to /generate within 5 s, and it fails its health check"
    try:
        with pytest.raises(EngineUnavailable, match=expected):
            engine.generate(requests)
        assert posted == ["/generate"]  # raised at the first failure, not retried: the controller decides what next
        assert not engine.health()  # so the controller restarts it
    finally:
        if fault == "timeout":
            os.killpg(pid, signal.SIGKILL)


def test_a_server_that_cannot_start_names_its_exit_code_and_log(tiny_model_dir):
    config = STAND_IN.model_copy(update={"extra_args": ["--no-such-flag"]})
    with pytest.raises(
        RuntimeError,
        match=r"(?s)exited with code 2 while starting; its log ends:.*unrecognized arguments: --no-such-flag",
    ):
        _start(tiny_model_dir, config=config)


def test_a_server_whose_port_was_taken_before_it_bound_it_starts_on_another(tiny_model_dir, tokenizer, monkeypatch):
    """The port is free when the engine chooses it, but the server binds it only once it is up: a process that takes
    it meanwhile makes the server exit ("address already in use"), and the engine starts it again on another port."""
    with socket.socket() as thief, socket.socket() as spare:
        thief.bind(("127.0.0.1", 0))
        thief.listen()
        spare.bind(("127.0.0.1", 0))
        ports = iter([thief.getsockname()[1], spare.getsockname()[1]])
        spare_port = spare.getsockname()[1]
        spare.close()
        monkeypatch.setattr(sglang_engine, "_free_port", lambda: next(ports))
        engine = _start(tiny_model_dir)
        try:
            assert engine.url == f"http://127.0.0.1:{spare_port}"
            assert engine.generate(make_requests(tokenizer, ["1+2="], max_new_tokens=2))
        finally:
            engine.shutdown()


def test_the_server_dies_with_its_engine_actor(ray_session, tiny_model_dir):
    """A killed actor (a hang, a restart) must not leave its server holding the port and the GPU."""
    actor = ray.remote(SGLangEngine).options(num_cpus=1).remote(str(tiny_model_dir), device="cpu", config=STAND_IN)
    pid = sglang_server_pid(actor)
    ray.kill(actor)
    assert eventually(lambda: not _alive(pid), timeout_s=20, every_s=0.2)


def _running(engine) -> bool:
    """A request runs on the server: it refuses (400) to flush its cache."""
    return httpx.post(f"{engine.url}/flush_cache", trust_env=False).status_code == 400


def _decode_steps(engine) -> int:
    """The decode steps the stand-in ran since the last /test_fault."""
    return httpx.get(f"{engine.url}/test_decode_steps", trust_env=False).json()["decode_steps"]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is dead, only not yet reaped
        return stat.read().split(")")[-1].split()[0] != "Z"


def testtoken_versions_come_from_the_weight_versions_spans():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions({"weight_version": "4", "weight_versions": spans}, 5) == [3, 3, 4, 4, 4]
    assert token_versions({"weight_version": "4"}, 3) == [4, 4, 4]  # no push came while it ran
    with pytest.raises(EngineUnavailable, match="do not cover the 6 output tokens"):
        token_versions({"weight_version": "4", "weight_versions": spans}, 6)


def test_a_push_mid_generation_continues_the_requests_on_the_new_weights(tiny_model_dir, tokenizer, tmp_path):
    """As SGLang with pause mode retract: the requests in flight wait out the refit and go on with the new weights;
    the server reports where the version changed (`weight_versions` spans), requests done before keep the old
    version and those that start after get the new one."""
    engine = _start(tiny_model_dir, weight_version=3, max_running_requests=2)
    pushed = weights_directory(tiny_model_dir, perturbed_weights(tiny_model_dir, 1, 0.05), tmp_path / "4")
    try:
        httpx.post(f"{engine.url}/test_fault", json={"decode_delay_s": 0.05}, trust_env=False).raise_for_status()
        body = {
            "input_ids": [tokenizer(p)["input_ids"] for p in ["1+2=", "45+67=", "3+4=", "9+9=", "5+6=", "7+0="]],
            "sampling_params": {"max_new_tokens": 12, "ignore_eos": True, "sampling_seed": 1},
            "return_logprob": True,
        }
        outputs: list = []
        thread = threading.Thread(
            target=lambda: outputs.extend(httpx.post(f"{engine.url}/generate", json=body, timeout=60).json())
        )
        thread.start()
        # Three waves of two requests, 12 steps each: the push comes once the second wave is under way.
        assert eventually(lambda: _decode_steps(engine) >= 14, every_s=0.05), "the first wave never finished"
        engine.update_weights_from_disk(str(pushed), 4)
        thread.join(60)
    finally:
        engine.shutdown()
    versions = [token_versions(o["meta_info"], len(o["output_ids"])) for o in outputs]
    assert all(len(v) == 12 for v in versions)  # no token lost or repeated
    assert [3] * 12 in versions and [4] * 12 in versions
    split = [v for v in versions if v[0] == 3 and v[-1] == 4]
    assert split and all(v == sorted(v) for v in split)
    assert all(o["meta_info"]["weight_version"] == "4" for o, v in zip(outputs, versions, strict=True) if v[-1] == 4)


@pytest.mark.parametrize(
    "device, dtype, asked, chosen",
    [
        ("cpu", "float32", None, "torch_native"),  # SGLang's CPU default needs kernels that are not published
        ("cuda", "float32", None, "triton"),  # FlashAttention 3, Hopper's default, takes 16-bit dtypes only
        ("cuda", "bfloat16", None, None),  # SGLang's own choice
        ("cuda", "float32", "triton", "triton"),
        ("cuda", "bfloat16", "fa3", "fa3"),
    ],
)
def test_the_attention_backend_follows_the_device_and_the_served_dtype(device, dtype, asked, chosen):
    assert choose_attention_backend(SGLangConfig(attention_backend=asked), device, dtype) == chosen


def test_float32_on_a_gpu_backend_that_refuses_it_is_refused_before_any_server_starts(tiny_model_dir):
    config = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "rollout.engine=sglang",
            "rollout.device=cuda",
            "rollout.sglang.attention_backend=fa3",
        ],
    )
    with pytest.raises(
        ValueError, match=r"attention_backend=fa3 takes 16-bit weights only, and rollout.dtype serves float32"
    ):
        SGLangEngine.launch_args(str(tiny_model_dir), 0, config.rollout, [])
