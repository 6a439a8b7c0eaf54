"""InferenceController on Ray: concurrent callers meet in the engines' batches and each gets its own results."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import threading

import httpx
import pytest
import ray
import torch

from miles.config import AdapterConfig, RolloutConfig, load_config
from miles.engines.torch_engine import TorchEngine
from miles.rollout import inference_controller
from miles.rollout.inference_controller import EngineRestarted, InferenceController
from tests.helpers import perturbed_weights, sglang_overrides, weights_push
from tests.helpers.faults import actor_pid, sglang_server_pid
from tests.helpers.samples import make_requests, seeded


@pytest.fixture(scope="module")
def controller(ray_session, tiny_model_dir):
    """Two engines, so that a merged batch is also split differently across engines than each call alone."""
    controller = InferenceController(str(tiny_model_dir), 2, RolloutConfig(num_engines=2, num_threads=1))
    yield controller
    controller.shutdown()


def _assert_same_samples(got, expected):
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        assert (g.output_ids, g.finish_reason, g.weight_version) == (e.output_ids, e.finish_reason, e.weight_version)
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-5, rtol=0)


def _concurrently(controller, calls: dict[str, list]) -> dict[str, list]:
    """Run `controller.generate(calls[k])` in one thread per key, all started together: their requests meet in the
    engines' running batches."""
    results: dict[str, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(calls))

    def call(key):
        barrier.wait()
        try:
            results[key] = controller.generate(calls[key])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(k,)) for k in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_concurrent_callers_get_their_own_results_in_order(controller, tokenizer):
    calls = {
        "x": seeded(make_requests(tokenizer, ["1+2=", "45+67=", "12+"] * 2, max_new_tokens=6), 1),
        "y": seeded(make_requests(tokenizer, ["9+99=", "3+4="] * 3, max_new_tokens=6), 2),
        "z": seeded(make_requests(tokenizer, ["70+1=", "5+", "66+33="], max_new_tokens=6), 3),
    }
    alone = {k: controller.generate(v) for k, v in calls.items()}
    together = _concurrently(controller, calls)
    for key in calls:
        _assert_same_samples(together[key], alone[key])
    assert {r.weight_version for rs in together.values() for r in rs} == {2}


def test_concurrent_callers_of_two_adapters(controller, tokenizer, make_lora):
    (ta, ca), (tb, cb) = make_lora(1), make_lora(2)
    controller.load_adapter("a", ray.put(ta), ca, 7)
    controller.load_adapter("b", ray.put(tb), cb, 8)
    # Left loaded: base requests are unaffected by loaded adapters (the engine's adapter tests check that).
    plain = seeded(make_requests(tokenizer, ["1+2=", "45+67=", "12+", "9+99="], max_new_tokens=6), 4)
    calls = {
        "base": plain,
        "a": [dataclasses.replace(r, adapter="a") for r in plain],
        "b": [dataclasses.replace(r, adapter="b") for r in plain],
    }
    alone = {k: controller.generate(v) for k, v in calls.items()}
    assert {r.weight_version for r in alone["a"]} == {7}
    assert {r.weight_version for r in alone["b"]} == {8}
    assert {r.weight_version for r in alone["base"]} == {2}
    assert [r.logprobs for r in alone["a"]] != [r.logprobs for r in alone["b"]]
    assert [r.logprobs for r in alone["a"]] != [r.logprobs for r in alone["base"]]

    together = _concurrently(controller, calls)
    for key in calls:
        _assert_same_samples(together[key], alone[key])


def test_a_bad_caller_is_refused_without_failing_concurrent_callers(controller, tokenizer):
    good = seeded(make_requests(tokenizer, ["1+2=", "45+67="], max_new_tokens=4), 8)
    bad = [dataclasses.replace(r, adapter="never-loaded") for r in good]
    expected = controller.generate(good)
    outcome: dict[str, object] = {}
    start = threading.Barrier(2)

    def call(key, requests):
        start.wait()
        try:
            outcome[key] = controller.generate(requests)
        except ValueError as exc:
            outcome[key] = exc

    threads = [threading.Thread(target=call, args=kv) for kv in (("bad", bad), ("good", good))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(outcome["bad"], ValueError) and "never-loaded" in str(outcome["bad"])
    _assert_same_samples(outcome["good"], expected)


# ---------------------------------------------------------------- engine death and hangs


@pytest.fixture(params=["torch", "sglang"])
def recovering(request, ray_session, tiny_model_dir, make_lora, tmp_path):
    """An engine holding pushed weights (version 5) and an adapter, so that a restart must restore both. One engine:
    the module's two-engine controller still holds two of the session's three Ray CPUs. The faults hit the
    process that generates: the TorchEngine actor, or the SGLang engine's server."""
    overrides = sglang_overrides() if request.param == "sglang" else []
    rollout = load_config(None, ["rollout.num_threads=1", "rollout.engine_timeout_s=20", *overrides]).rollout
    controller = InferenceController(str(tiny_model_dir), 0, rollout, [AdapterConfig(name="a")])
    controller.generating_pid = lambda: (sglang_server_pid if request.param == "sglang" else actor_pid)(
        controller.engines[0]
    )
    controller.update_weights(
        weights_push(rollout, tiny_model_dir, perturbed_weights(tiny_model_dir, 11, 0.02), 5, tmp_path)
    )
    controller.push_directory, controller.rollout = tmp_path, rollout
    # Engines serving adapters refuse full-weight pushes, so the adapter comes after the weights.
    tensors, config = make_lora(3)
    controller.load_adapter("a", ray.put(tensors), config, 9)
    yield controller
    controller.shutdown()


def _mixed_requests(tokenizer):
    plain = seeded(make_requests(tokenizer, ["1+2=", "45+67=", "12+", "9+99="] * 2, max_new_tokens=6), 21)
    return plain + [dataclasses.replace(r, adapter="a", seed=r.seed + 100) for r in plain]


def _generate_while(controller, requests, fault, monkeypatch) -> BaseException:
    """Start `controller.generate(requests)` with the engine stopped (SIGSTOP); once the controller waits for the
    engines' answers (the batch in flight on the stopped engine), apply `fault` to the engine's pid, and return what
    the call raised."""
    pid = controller.generating_pid()
    os.kill(pid, signal.SIGSTOP)
    outcome: list[BaseException] = []
    waiting_for_engines = threading.Event()
    wait = ray.wait

    def observed_wait(*args, **kwargs):
        waiting_for_engines.set()
        return wait(*args, **kwargs)

    monkeypatch.setattr(ray, "wait", observed_wait)

    def call():
        try:
            controller.generate(requests)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            outcome.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    assert waiting_for_engines.wait(60), "generate never called the engines"
    fault(pid)
    thread.join(120)
    assert outcome, "generate returned although an engine was down"
    return outcome[0]


def test_killed_engine_is_restarted_with_weights_and_adapters_and_the_retry_matches(recovering, tokenizer, monkeypatch):
    requests = _mixed_requests(tokenizer)
    expected = recovering.generate(requests)
    old_engine = recovering.engines[0]

    error = _generate_while(recovering, requests, lambda pid: os.kill(pid, signal.SIGKILL), monkeypatch)

    assert isinstance(error, EngineRestarted)
    assert "restarted engines [0]" in str(error) and "weight version 5" in str(error) and "'a': 9" in str(error)
    assert recovering.engines[0] is not old_engine
    assert ray.get(recovering.engines[0].weight_version.remote()) == 5
    assert ray.get(recovering.engines[0].adapter_versions.remote()) == {"a": 9}
    _assert_same_samples(recovering.generate(requests), expected)  # the same tokens as before the death


def test_hung_engine_is_restarted_after_the_timeout(recovering, tokenizer, monkeypatch):
    requests = _mixed_requests(tokenizer)
    expected = recovering.generate(requests)
    recovering.timeout_s = 3

    error = _generate_while(recovering, requests, lambda pid: None, monkeypatch)  # stays stopped: a hang

    assert isinstance(error, EngineRestarted) and "engines [0] gave no answer within 3 s" in str(error)
    _assert_same_samples(recovering.generate(requests), expected)


def test_a_refused_push_is_not_an_engine_death(recovering, tiny_model_dir):
    engines = list(recovering.engines)
    weights = perturbed_weights(tiny_model_dir, 11, 0.02)
    push = weights_push(recovering.rollout, tiny_model_dir, weights, 6, recovering.push_directory)
    with pytest.raises(ValueError, match="frozen"):  # the engines serve an adapter, so a full push is refused
        recovering.update_weights(push)
    assert recovering.engines == engines


def test_a_failing_sglang_server_is_restarted(ray_session, tiny_model_dir, tokenizer):
    """A server that answers 5xx (its scheduler died) fails its health check and is replaced; the retry succeeds."""
    rollout = load_config(None, ["rollout.num_threads=1", *sglang_overrides()]).rollout
    controller = InferenceController(str(tiny_model_dir), 0, rollout)
    try:
        requests = seeded(make_requests(tokenizer, ["1+2=", "45+67="], max_new_tokens=6), 5)
        expected = controller.generate(requests)
        url = ray.get(controller.engines[0].__ray_call__.remote(lambda self: self.url))
        httpx.post(f"{url}/test_fault", json={"status": 500}, trust_env=False).raise_for_status()

        with pytest.raises(EngineRestarted, match="answered 500"):
            controller.generate(requests)
        _assert_same_samples(controller.generate(requests), expected)
    finally:
        controller.shutdown()


def test_a_batch_longer_than_the_timeout_on_a_healthy_server_is_waited_for(ray_session, tiny_model_dir, tokenizer):
    """engine_timeout_s is not a bound on a batch: past it a busy server passes its health check and is waited for."""
    rollout = load_config(None, ["rollout.num_threads=1", *sglang_overrides()]).rollout
    controller = InferenceController(str(tiny_model_dir), 0, rollout)
    try:
        requests = seeded(make_requests(tokenizer, ["1+2=", "45+67="], max_new_tokens=6), 5)
        expected = controller.generate(requests)
        controller.timeout_s = 1
        engines = list(controller.engines)
        url = ray.get(controller.engines[0].__ray_call__.remote(lambda self: self.url))
        httpx.post(f"{url}/test_fault", json={"generate_delay_s": 4.0}, trust_env=False).raise_for_status()

        _assert_same_samples(controller.generate(requests), expected)  # four timeouts long
        assert controller.engines == engines  # none restarted
    finally:
        controller.shutdown()


def test_a_server_that_dies_loading_weights_is_restarted_and_the_retried_push_lands(
    ray_session, tiny_model_dir, tokenizer, tmp_path
):
    """A failed disk load can take an SGLang server down: an engine death (restart), not a refused request; the
    sync task's retry pushes again."""
    rollout = load_config(None, ["rollout.num_threads=1", *sglang_overrides()]).rollout
    controller = InferenceController(str(tiny_model_dir), 0, rollout)
    try:
        url = ray.get(controller.engines[0].__ray_call__.remote(lambda self: self.url))
        httpx.post(f"{url}/test_fault", json={"die_on_load": True}, trust_env=False).raise_for_status()
        weights = perturbed_weights(tiny_model_dir, 12, 0.02)
        push = weights_push(rollout, tiny_model_dir, weights, 1, tmp_path)

        with pytest.raises(
            EngineRestarted, match=r"update_weights_from_disk failed .*restarted engines \[0\] with weight version 0"
        ):
            controller.update_weights(push)
        controller.update_weights(push)

        assert ray.get(controller.engines[0].weight_version.remote()) == 1
        reference = TorchEngine(str(tiny_model_dir), num_threads=1)
        reference.update_weights(weights, 1)
        requests = seeded(make_requests(tokenizer, ["1+2=", "45+67="], max_new_tokens=6), 5)
        _assert_same_samples(controller.generate(requests), reference.generate(requests))
    finally:
        controller.shutdown()


def test_a_tensor_push_stopped_between_buckets_ends_every_session_and_is_pushed_whole_again(
    ray_session, tiny_model_dir, tokenizer, small_config
):
    """The tensor transport pushes a bucket a round (the trainer gathers the next once the engines loaded the last).
    A server that dies on the first bucket of version 2 while the other has loaded it: the dead one restarts with the
    trainer's weights, the other ends its push and generates again, and version 2 is not taken as served though the
    restarted engine holds it whole: the retry pushes every engine whole, and both serve the trainer's weights."""
    from miles.cluster.actors import RestartableActor
    from miles.rollout.weight_transport import TensorPush, TrainerWeights
    from miles.state.run_dir import RunDir
    from miles.train.actor import TrainActor
    from miles.train.group import start_trainer_group

    config = small_config(
        *sglang_overrides(),
        "rollout.num_engines=2",
        "rollout.weight_transport=tensor",
        "train.weight_bucket_mb=0.5",  # the tiny model's 1.6 MiB go in four buckets
    )
    RunDir(config.run_dir).create()
    trainer = RestartableActor("trainer", lambda: start_trainer_group(config, tiny_model_dir, None))
    controller = InferenceController(str(tiny_model_dir), 0, config.rollout)
    held = [0]  # the trainer's version

    def train_to(version: int) -> dict:
        weights = perturbed_weights(tiny_model_dir, 14 + version, 0.02)
        ray.get(trainer.handles[0].__ray_call__.remote(lambda actor: actor.model.load_state_dict(weights)))
        held[0] = version
        return weights

    try:
        source = TrainerWeights(trainer, None, version=lambda: held[0], probe=lambda: None)
        assert trainer.call(TrainActor.begin_weight_payloads) > 1
        train_to(1)
        controller.update_weights(TensorPush(source, 1))
        weights = train_to(2)
        url = ray.get(controller.engines[1].__ray_call__.remote(lambda engine: engine.url))
        httpx.post(f"{url}/test_fault", json={"die_on_load": True}, trust_env=False).raise_for_status()

        with pytest.raises(EngineRestarted, match=r"update_weights_from_tensor failed .*restarted engines \[1\]"):
            controller.update_weights(TensorPush(source, 2))
        assert not controller.serves(2)
        requests = seeded(make_requests(tokenizer, ["1+2=", "45+67=", "8+9=", "10+11="], max_new_tokens=6), 5)
        _concurrently(controller, {"after the stopped push": requests})  # engine 0 ended the push it was in
        controller.update_weights(TensorPush(source, 2))

        assert controller.serves(2)
        assert ray.get([engine.weight_version.remote() for engine in controller.engines]) == [2, 2]
        reference = TorchEngine(str(tiny_model_dir), num_threads=1)
        reference.update_weights(weights, 2)
        _assert_same_samples(controller.generate(requests), reference.generate(requests))
    finally:
        controller.shutdown()
        trainer.kill()


def test_a_push_whose_weights_the_server_skips_is_refused_as_lost_and_a_whole_one_lands(
    ray_session, tiny_model_dir, tmp_path
):
    """Pins the push check's first half through the controller: the engines started from the trainer's weights
    (`hold`); a push whose tensor names the server does not know (skipped, the load still succeeds) leaves its
    checksum as it was while the trainer's fingerprint moved: refused, naming the engine; the same weights under the
    right names land."""
    from transformers import AutoModelForCausalLM

    from miles.rollout.weight_transport import DiskPush
    from tests.helpers import weights_directory, weights_probe

    rollout = load_config(None, ["rollout.num_threads=1", *sglang_overrides()]).rollout
    controller = InferenceController(str(tiny_model_dir), 0, rollout)
    try:
        start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
        controller.hold(weights_probe(tiny_model_dir, start))
        weights = perturbed_weights(tiny_model_dir, 13, 1e-3)  # a step too small for the log-probs to tell
        probe = weights_probe(tiny_model_dir, weights)
        prefixed = {f"module.{name}": tensor for name, tensor in weights.items()}
        lost = DiskPush(weights_directory(tiny_model_dir, prefixed, tmp_path / "lost"), 1, probe)
        with pytest.raises(ValueError, match=r"engines \[0\] reported weights version 1 loaded, but the weights they"):
            controller.update_weights(lost)
        controller.update_weights(DiskPush(weights_directory(tiny_model_dir, weights, tmp_path / "1"), 1, probe))
        assert controller.weight_version() == 1
    finally:
        controller.shutdown()


def test_an_engine_that_cannot_start_reports_why(ray_session, tiny_model_dir, tokenizer):
    rollout = load_config(None, [*sglang_overrides(), "rollout.sglang.extra_args=[--no-such-flag]"]).rollout
    controller = InferenceController(str(tiny_model_dir), 0, rollout)
    try:
        with pytest.raises(
            EngineRestarted,
            match=r"(?s)generate failed \(failed to start: RuntimeError: sglang server .* exited "
            r"with code 2 while starting; its log ends:.*unrecognized arguments: --no-such-flag",
        ):
            controller.generate(make_requests(tokenizer, ["1+2="]))
    finally:
        controller.shutdown()


def test_a_long_generation_reports_its_progress(ray_session, tiny_model_dir, tokenizer, monkeypatch, caplog):
    """Requests of up to 1 to 8 tokens (the model's EOS may end them sooner) at 0.6 s a decode step: the report after
    0.5 s and every 0.5 s then counts those finished so far, as the engine's own counters have them."""
    monkeypatch.setattr(inference_controller, "PROGRESS_AFTER_S", 0.5)
    monkeypatch.setattr(inference_controller, "PROGRESS_EVERY_S", 0.5)
    rollout = load_config(None, ["rollout.num_threads=1", *sglang_overrides()]).rollout
    controller = InferenceController(str(tiny_model_dir), 0, rollout)
    try:
        requests = [
            dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, max_new_tokens=n, stop_token_ids=()))
            for n, r in enumerate(seeded(make_requests(tokenizer, ["1+2="] * 8), 5), start=1)
        ]
        url = ray.get(controller.engines[0].__ray_call__.remote(lambda self: self.url))
        httpx.post(f"{url}/test_fault", json={"decode_delay_s": 0.6}, trust_env=False).raise_for_status()
        with caplog.at_level(logging.INFO, logger=inference_controller.__name__):
            results = controller.generate(requests)
    finally:
        controller.shutdown()
    reports = [re.search(r"generating: (\d+) of 8 requests done, (\d+) tokens", m) for m in caplog.messages]
    done = [(int(r.group(1)), int(r.group(2))) for r in reports if r]
    assert len(done) >= 2 and done == sorted(done) and 0 < done[-1][0] < 8
    # shorter requests finish first: the n done hold the n shortest results' tokens
    lengths = sorted(len(r.output_ids) for r in results)
    assert all(tokens == sum(lengths[:finished]) for finished, tokens in done)


def test_engines_on_cuda_in_a_cluster_without_a_gpu_are_refused_at_once(ray_session, tiny_model_dir):
    """Ray would keep them pending until a GPU joins; a cluster run (no local check) is told at once."""
    with pytest.raises(ValueError, match=r"^rollout.device=cuda: the Ray cluster has no GPU \(its resources: "):
        InferenceController(str(tiny_model_dir), 0, RolloutConfig(device="cuda"))
