"""SGLangEngine: one SGLang HTTP server, started and driven from its Ray actor (the GPU path of `generate`).

The server is `python -m sglang.launch_server` (SGLang 0.5.23), bound to 127.0.0.1 on a free port, run by the
Python of SGLang's own environment when `rollout.sglang.python` names one. Requests
carry token ids and come back as token ids with their log-probs, so nothing is re-tokenized. Full weights arrive
inside a paused weight-update session, from the model directory the trainer wrote (`/update_weights_from_disk`) or
broadcast by the trainer over a weight-update group (`/update_weights_from_distributed`); the prefix cache is
flushed with each load, and the controller checks what is served (miles.weights.check). Adapters are
written as PEFT directories and loaded with `/load_lora_adapter`. Nothing needs pickle.

A refused connection, a 5xx answer, or a generation that outlasts `timeout_s` while the server fails its health check
raises EngineUnavailable, and `health()` is False once `/health_generate` fails: the InferenceController then
restarts the engine. A long generation on a healthy server is waited for. SGLang is never imported here.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

import httpx
import torch
from safetensors.torch import save_file

from miles.cluster.memory_budget import colocated_engine_share
from miles.cluster.placement import gpu_memory_bytes, on_gpus, torch_device
from miles.config import AdapterConfig, RolloutConfig, SGLangConfig
from miles.engines.base import (
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
    GenerationProgress,
    check_adapters_loaded,
    check_memory_tags,
    shared_launch_args,
)
from miles.state.checkpoint import unshared, weights_dtype
from miles.weights.group import FLATTENED, TensorSpec, WeightGroup

log = logging.getLogger(__name__)

CPU_KV_CACHE_TOKENS = 8192
NONDETERMINISTIC_BACKENDS = {"torch_native"}  # SGLang refuses --enable-deterministic-inference with these
FLOAT32_BACKENDS = {"triton", "torch_native"}  # SGLang's GPU attention backends that take float32
_PR_SET_PDEATHSIG = 1
_LOG_TAIL_LINES = 30
_POLL_S = 0.5
_PORT_ATTEMPTS = 3
_PORT_TAKEN = "address already in use"  # uvicorn's bind error, in the server's log


class SGLangEngine:
    weight_transports = ("disk", "tensor", "distributed")  # a server loads in its own process: no object store
    distributed_load_format = FLATTENED  # one collective per bucket, as SGLang recommends, not one per tensor

    @classmethod
    def launch_args(
        cls,
        model_dir: str,
        weight_version: int,
        rollout: RolloutConfig,
        adapters: Sequence[AdapterConfig],
        colocated_trainer_bytes: float | None = None,
    ) -> dict[str, Any]:
        dtype = cls.served_dtype(model_dir, rollout)
        choose_attention_backend(rollout.sglang, rollout.device, dtype)  # refused here, before any server starts
        args = {
            **shared_launch_args(model_dir, weight_version, rollout, dtype),
            "config": rollout.sglang,
            "timeout_s": rollout.engine_timeout_s,
            "colocated_trainer_bytes": colocated_trainer_bytes,
        }
        if adapters:  # the server sizes its LoRA pool by them
            args.update(
                lora_rank=max(a.rank for a in adapters),
                lora_target_modules=sorted({m for a in adapters for m in a.target_modules}),
            )
        return args

    @classmethod
    def ranks(cls, rollout: RolloutConfig) -> int:
        return rollout.sglang.tp_size

    @classmethod
    def served_dtype(cls, model_dir: str, rollout: RolloutConfig) -> str:
        return weights_dtype(Path(model_dir)) if rollout.dtype == "auto" else rollout.dtype

    def __init__(
        self,
        model_dir: str,
        weight_version: int = 0,
        device: str = "cuda",
        dtype: str = "float32",
        config: SGLangConfig | None = None,
        timeout_s: float = 600.0,
        lora_rank: int | None = None,
        lora_target_modules: list[str] | None = None,
        max_running_requests: int | None = None,
        pause_generation_mode: str = "retract",
        colocated_trainer_bytes: float | None = None,
    ):
        self.model_dir = Path(model_dir)
        self.pause_generation_mode = pause_generation_mode
        self.config = config or SGLangConfig()
        self._weight_version = weight_version
        self._adapter_versions: dict[str, int] = {}
        self._weight_group: str | None = None  # the weight-update group the server is in
        self._open_push: int | None = None  # the version whose push in parts holds SGLang's session open
        self._released: set[str] = set()
        # SGLang releases memory on GPUs only: on a CPU its release ends in torch.cuda.synchronize and the scheduler
        # dies (0.5.23), and there is no memory saver to give anything back.
        self._releases_on_server = on_gpus(device)
        self._work_dir = Path(tempfile.mkdtemp(prefix="miles-sglang-"))
        self._log_path = self._work_dir / "server.log"
        self.timeout_s = timeout_s
        on_cpu = torch_device(device).type == "cpu"
        # SGLang's CPU engine is chosen by this variable; without it `--device cpu` still reaches CUDA-only kernels.
        environment = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"} if on_cpu else None
        # The port is free when it is chosen, but the server binds it only once it is up, seconds later, and another
        # process may take it meanwhile: a server that exits for that starts again on another port.
        for attempt in range(1, _PORT_ATTEMPTS + 1):
            port = _free_port()
            self.url = f"http://127.0.0.1:{port}"
            self._http = httpx.Client(
                base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False
            )
            command = launch_command(
                model_dir, port, weight_version, device, dtype, self.config, lora_rank, lora_target_modules,
                max_running_requests, colocated_trainer_bytes,
            )  # fmt: skip
            log_start = self._log_path.stat().st_size if self._log_path.exists() else 0
            with open(self._log_path, "ab") as server_log:
                # Its own process group, so shutdown stops the server's workers too; and it dies with this actor, so a
                # killed actor never leaves a server holding the GPU and the port.
                self._process = subprocess.Popen(
                    command,
                    stdout=server_log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=environment,
                    start_new_session=True,
                    preexec_fn=_die_with_parent,
                )
            if self._wait_until_ready(self.config.startup_timeout_s, log_start, may_retry=attempt < _PORT_ATTEMPTS):
                return
            log.warning("sglang server: port %d was taken before the server bound it; starting on another", port)
            self._http.close()

    def _wait_until_ready(self, timeout_s: float, log_start: int, may_retry: bool) -> bool:
        """True once the server answers; False when it exited because its port was taken and a retry `may_retry`;
        else the start failed: raise with its log."""
        deadline = time.monotonic() + timeout_s
        while self._process.poll() is None and time.monotonic() < deadline:
            if self.health() and self._process.poll() is None:  # ours answered, not whoever took its port
                log.info("sglang server at %s is up; its log: %s", self.url, self._log_path)
                return True
            time.sleep(_POLL_S)
        exited = self._process.poll()
        if exited is not None and may_retry and _PORT_TAKEN in self._log_since(log_start):
            return False
        what = (
            f"exited with code {exited}"
            if exited is not None
            else f"did not answer /health_generate within {timeout_s:g} s"
        )
        message = f"sglang server at {self.url} {what} while starting; its log ends:\n{self._log_tail()}"
        self.shutdown()
        raise RuntimeError(message)

    def _log_since(self, offset: int) -> str:
        with open(self._log_path, "rb") as server_log:
            server_log.seek(offset)
            return server_log.read().decode(errors="replace")

    def _log_tail(self) -> str:
        try:
            with open(self._log_path, errors="replace") as server_log:
                return "".join(deque(server_log, maxlen=_LOG_TAIL_LINES))
        except OSError:
            return "(no log)"

    def _post(self, path: str, body: dict | None = None, timeout: httpx.Timeout | None = None) -> httpx.Response:
        """POST to the server. Its death (refused connection, 5xx, timeout) raises EngineUnavailable; a 4xx, which
        is a request the server refused, raises ValueError with the server's message."""
        try:
            response = self._http.post(
                path, json=body if body is not None else {}, timeout=timeout or self._http.timeout
            )
        except httpx.TimeoutException as exc:
            raise EngineUnavailable(
                f"sglang server at {self.url}: no answer to {path} within the timeout ({exc!r})"
            ) from None
        except httpx.TransportError as exc:
            exited = self._process.poll()
            state = f"exited with code {exited}; its log ends:\n{self._log_tail()}" if exited is not None else "running"
            raise EngineUnavailable(f"sglang server at {self.url}: {path} failed: {exc!r} (server {state})") from None
        if response.status_code >= 500:
            raise EngineUnavailable(
                f"sglang server at {self.url}: {path} answered {response.status_code}: {response.text[:500]}"
            )
        if response.status_code >= 400:
            raise ValueError(
                f"sglang server at {self.url} refused {path} ({response.status_code}): {response.text[:500]}"
            )
        return response

    def weight_version(self) -> int:
        return self._weight_version

    def adapter_versions(self) -> dict[str, int]:
        return dict(self._adapter_versions)

    def health(self) -> bool:
        """The server's one-token probe generation, unless this engine holds generation off (a push in parts open,
        memory released), where the probe would wait: then the server answering at all."""
        if self._process.poll() is not None:
            return False
        path = "/model_info" if self._open_push is not None or self._released else "/health_generate"
        try:
            return self._http.get(path, timeout=self.config.health_timeout_s).status_code == 200
        except httpx.HTTPError:
            return False

    def progress(self) -> GenerationProgress:
        """From the server's Prometheus counters, summed over their label sets."""
        text = self._http.get("/metrics", timeout=self.config.health_timeout_s).text
        return GenerationProgress(
            int(_counter(text, "sglang:num_requests_total")), int(_counter(text, "sglang:generation_tokens_total"))
        )

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        if not requests:
            return []
        self._check_memory_held("generate")
        check_adapters_loaded(requests, self._adapter_versions)
        body = {
            "input_ids": [r.prompt_ids for r in requests],
            "sampling_params": [_sampling_params(r) for r in requests],
            "return_logprob": True,
        }
        if any(r.adapter for r in requests):  # a server without --enable-lora refuses any lora_path, even [null, ...]
            body["lora_path"] = [r.adapter for r in requests]
        outputs = self._post_while_healthy("/generate", body).json()
        if len(outputs) != len(requests):
            raise EngineUnavailable(
                f"sglang server at {self.url} answered {len(outputs)} outputs for {len(requests)} requests"
            )
        results = [
            self._result(i, request, output["meta_info"])
            for i, (request, output) in enumerate(zip(requests, outputs, strict=True))
        ]
        aborted = [i for i, r in enumerate(results) if r.finish_reason == "abort"]
        if aborted:  # a refit pauses without aborting, so an abort is the server's failure; a retry regenerates
            message = outputs[aborted[0]]["meta_info"]["finish_reason"].get("message", "")
            raise RuntimeError(
                f"sglang server at {self.url} aborted {len(aborted)} of {len(requests)} requests: {message}"
            )
        return results

    def _post_while_healthy(self, path: str, body: dict) -> httpx.Response:
        """POST and wait for the answer as long as the server is healthy: each time timeout_s passes without one, a
        passing health check (a busy server answers it) means another wait, a failing one EngineUnavailable. A long
        batch is not a hung server."""
        answer: Future[httpx.Response] = Future()

        def post() -> None:
            try:
                answer.set_result(self._post(path, body, timeout=httpx.Timeout(None, connect=10.0)))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                answer.set_exception(exc)

        threading.Thread(target=post, name=f"sglang-post-{path.strip('/')}", daemon=True).start()
        while True:
            try:
                return answer.result(timeout=self.timeout_s)
            except FutureTimeout:
                if not self.health():
                    raise EngineUnavailable(
                        f"sglang server at {self.url}: no answer to {path} within {self.timeout_s:g} s, and it fails "
                        "its health check"
                    ) from None

    def _result(self, index: int, request: GenerateRequest, meta: dict) -> GenerateResult:
        pairs = meta["output_token_logprobs"]  # [(logprob, token_id, text or None), ...]
        missing = [position for position, pair in enumerate(pairs) if pair[0] is None]
        if missing:  # the server's failure, not the request's: a RuntimeError, which the generate task retries
            raise RuntimeError(
                f"sglang server at {self.url} gave null log-probs for request {index} of the batch (seed "
                f"{request.seed}, {len(request.prompt_ids)} prompt tokens) at output positions {missing[:5]}"
            )
        if request.adapter:
            versions = [self._adapter_versions[request.adapter]] * len(pairs)
        else:
            versions = token_versions(meta, len(pairs))
        return GenerateResult(
            output_ids=[int(p[1]) for p in pairs],
            logprobs=[float(p[0]) for p in pairs],
            finish_reason=meta["finish_reason"]["type"],
            weight_versions=versions,
        )

    def update_weights_from_disk(self, directory: str, version: int) -> None:
        """Load the model directory the trainer wrote (`/update_weights_from_disk`)."""
        self._check_base_weights_pushable()
        self._load(version, "/update_weights_from_disk", [{"model_path": directory, "abort_all_requests": False}])

    def update_weights_from_distributed(
        self,
        group: WeightGroup,
        rank_offset: int,
        buckets: list[list[TensorSpec]],
        version: int,
        load_format: str | None = None,
    ) -> None:
        """Receive the weights broadcast over the weight-update `group` (`/init_weights_update_group` as
        `rank_offset` when the group is new; it blocks until the trainer joins), one
        `/update_weights_from_distributed` per bucket."""
        self._check_base_weights_pushable()
        if self._weight_group != group.group_name:
            if self._weight_group is not None:
                self._post("/destroy_weights_update_group", {"group_name": self._weight_group})
                self._weight_group = None
            self._check_answers([self._post("/init_weights_update_group", group.request(rank_offset)).json()], version)
            self._weight_group = group.group_name
        bodies = [
            {
                "names": [name for name, _, _ in specs],
                "dtypes": [dtype for _, dtype, _ in specs],
                "shapes": [shape for _, _, shape in specs],
                "group_name": group.group_name,
                "load_format": load_format,
            }
            for specs in buckets
        ]
        self._load(version, "/update_weights_from_distributed", bodies)

    def update_weights_from_tensor(self, payloads: list[str], version: int, last: bool = True) -> None:
        """Load `/update_weights_from_tensor` payloads (miles.weights.payload), one request per flattened bucket; a
        push in parts keeps SGLang's session open from its first part to its `last`."""
        self._check_base_weights_pushable()
        bodies = [{"serialized_named_tensors": [p], "load_format": FLATTENED} for p in payloads]
        self._load(version, "/update_weights_from_tensor", bodies, last)

    def _check_base_weights_pushable(self) -> None:
        if self._adapter_versions:
            raise ValueError("the base weights of an engine serving LoRA adapters are frozen; push adapters instead")

    def _load(self, version: int, path: str, bodies: list[dict], last: bool = True) -> None:
        """POST each body to `path` as weights `version`, in SGLang's refit order: pause / begin / the loads / end /
        continue, the session kept open between the parts of a push in parts (`last` false but on its last part).
        Whatever fails, the session is closed and generation resumes. The requests in flight are paused, not aborted
        (rollout.pause_generation_mode), and go on with the new weights. The prefix (radix) cache, whose keys and
        values are the old weights', is flushed with the last load; in mode retract the paused requests wait in the
        queue, which a paused server's flush ignores, while in mode in_place they keep their cache and SGLang refuses
        a flush, so none is asked for."""
        if self._open_push not in (None, version):
            self.close_weight_update()  # a push of another version stopped part way
        if self._open_push is None:
            self._post("/pause_generation", {"mode": self.pause_generation_mode})
            try:
                self._post("/begin_weight_update")
            except BaseException:
                self._post("/continue_generation")
                raise
            self._open_push = version
        flush = self.pause_generation_mode != "in_place" and last
        try:
            answers = [
                self._post(
                    path, {**body, "weight_version": str(version), "flush_cache": flush and i == len(bodies) - 1}
                )
                for i, body in enumerate(bodies)
            ]
            self._check_answers([answer.json() for answer in answers], version)
        except BaseException:
            self.close_weight_update()
            raise
        if last:
            self.close_weight_update()
            self._weight_version = version

    def close_weight_update(self) -> None:
        if self._open_push is None:
            return
        self._open_push = None
        try:
            self._post("/end_weight_update")
        finally:
            self._post("/continue_generation")

    def sequence_logprobs(self, token_ids: list[int]) -> list[float]:
        """The prompt's own log-probs (`input_token_logprobs` from its first token on); the first token has none."""
        self._check_memory_held("sequence_logprobs")
        body = {
            "input_ids": token_ids,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        pairs = self._post("/generate", body).json()["meta_info"]["input_token_logprobs"]
        if len(pairs) != len(token_ids) or any(p[0] is None for p in pairs[1:]):
            raise EngineUnavailable(
                f"sglang server at {self.url} gave {len(pairs)} prompt log-probs for {len(token_ids)} tokens: {pairs}"
            )
        return [float(p[0]) for p in pairs[1:]]

    def weights_checksum(self) -> str | None:
        """SGLang's own checksum of the weights it serves (`/weights_checker`, action checksum: a hash of every tensor
        on every rank)."""
        return self._post("/weights_checker", {"action": "checksum"}).json()["per_engine_checksum"]

    def release_memory(self, tags: Sequence[str]) -> None:
        """`/release_memory_occupation` on a GPU, where `--enable-memory-saver` (a colocated server's) gives the memory
        back; the server asserts it is idle, which the controller sees to (a release mid-generation kills its
        scheduler). On a CPU the server keeps its memory; either way the engine serves nothing until resumed."""
        tags = [tag for tag in check_memory_tags(tags) if tag not in self._released]
        if tags and self._releases_on_server:
            self._post("/release_memory_occupation", {"tags": tags})
        self._released.update(tags)

    def resume_memory(self, tags: Sequence[str]) -> None:
        tags = [tag for tag in check_memory_tags(tags) if tag in self._released]
        if tags and self._releases_on_server:
            self._post("/resume_memory_occupation", {"tags": tags})
        self._released.difference_update(tags)

    def _check_memory_held(self, what: str) -> None:
        if self._released:  # the server would run on memory it gave back: its scheduler dies
            raise RuntimeError(
                f"{what}: sglang server at {self.url} released its {sorted(self._released)} memory; resume_memory (and "
                f"push the weights) first"
            )

    def _check_answers(self, answers: list[dict], version: int) -> None:
        failed = [answer.get("message") for answer in answers if not answer.get("success", False)]
        if failed:
            raise RuntimeError(f"sglang server at {self.url} failed to load weights version {version}: {failed[0]}")

    def load_adapter(self, name: str, named_tensors: dict[str, torch.Tensor], config: dict, version: int) -> None:
        """Load (or replace) LoRA adapter `name`: SGLang refuses a name loaded twice, so a new version unloads first."""
        self.unload_adapter(name)
        directory = self._work_dir / "adapters" / f"{name}-{version}"
        directory.mkdir(parents=True, exist_ok=True)
        save_file(unshared(named_tensors), directory / "adapter_model.safetensors")
        (directory / "adapter_config.json").write_text(json.dumps(config))
        self._post("/load_lora_adapter", {"lora_name": name, "lora_path": str(directory), "pinned": False})
        self._adapter_versions[name] = version

    def unload_adapter(self, name: str) -> None:
        if name not in self._adapter_versions:
            return
        self._post("/unload_lora_adapter", {"lora_name": name})
        version = self._adapter_versions.pop(name)
        shutil.rmtree(self._work_dir / "adapters" / f"{name}-{version}", ignore_errors=True)

    def shutdown(self) -> None:
        """Stop the server and its workers: SIGTERM, then SIGKILL after 30 s."""
        if self._process.poll() is None:
            os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._http.close()
        shutil.rmtree(self._work_dir, ignore_errors=True)


def launch_command(
    model_dir: str,
    port: int,
    weight_version: int,
    device: str,
    dtype: str,
    config: SGLangConfig,
    lora_rank: int | None = None,
    lora_target_modules: list[str] | None = None,
    max_running_requests: int | None = None,
    colocated_trainer_bytes: float | None = None,
) -> list[str]:
    """The `python -m sglang.launch_server ...` command of one engine's server, bound to 127.0.0.1 on `port`.
    `colocated_trainer_bytes`: what the trainer rank on the same GPU keeps there between steps (a colocated engine),
    from which the server's share of the GPU is derived unless rollout.sglang.mem_fraction_static sets it."""
    on_cpu = torch_device(device).type == "cpu"
    command = [
        config.python or sys.executable,
        "-m",
        config.server_module,
        "--model-path",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--device",
        torch_device(device).type,  # the CPU where GPUs are simulated (miles.cluster.placement)
        "--tp-size",
        str(config.tp_size),
        "--weight-version",
        str(weight_version),
        # explicit: SGLang's `auto` serves an fp32 checkpoint in fp16
        "--dtype",
        dtype,
        "--enable-metrics",  # /metrics: its counters of finished requests are the engine's progress
    ]
    attention_backend = choose_attention_backend(config, device, dtype)
    if attention_backend is not None:
        command += ["--attention-backend", attention_backend]
    if on_cpu:  # else its scheduler polls for requests while idle, a whole core taken from the trainer beside it
        command.append("--sleep-on-idle")
    max_total_tokens = config.max_total_tokens or (CPU_KV_CACHE_TOKENS if on_cpu else None)
    if max_total_tokens is not None:
        command += ["--max-total-tokens", str(max_total_tokens)]
    if max_running_requests is not None:
        command += ["--max-running-requests", str(max_running_requests)]
    mem_fraction_static = config.mem_fraction_static
    if colocated_trainer_bytes is not None and not on_cpu:
        # Its memory goes back to the GPU around each train step (release_memory), which only the saver can do.
        command.append("--enable-memory-saver")
        if mem_fraction_static is None:  # SGLang's default would size its KV cache from memory the trainer needs
            mem_fraction_static = colocated_engine_share(colocated_trainer_bytes, gpu_memory_bytes())
    if mem_fraction_static is not None:
        command += ["--mem-fraction-static", str(mem_fraction_static)]
    if lora_rank is not None:
        command += [
            "--enable-lora",
            "--max-lora-rank",
            str(lora_rank),
            "--max-loras-per-batch",
            str(config.max_loras_per_batch),
            "--lora-target-modules",
            *(lora_target_modules or []),
        ]
    if config.deterministic_inference and attention_backend not in NONDETERMINISTIC_BACKENDS:
        command.append("--enable-deterministic-inference")
    elif config.deterministic_inference:
        log.warning(
            "sglang: --attention-backend %s does not allow --enable-deterministic-inference; sampling_seed is not "
            "honoured, so a retried rollout samples other tokens",
            attention_backend,
        )
    return command + config.extra_args


def choose_attention_backend(config: SGLangConfig, device: str, dtype: str) -> str | None:
    """`--attention-backend`: rollout.sglang.attention_backend, else torch_native on a CPU (SGLang's CPU default needs a
    CPU build of its kernels, which is not published), triton for float32 on a GPU (SGLang's default there,
    FlashAttention 3 on Hopper, which deterministic inference also forces, takes only 16-bit dtypes), else SGLang's
    choice (None). A backend that cannot serve the dtype is refused, naming the fields."""
    on_cpu = device == "cpu"
    backend = config.attention_backend or ("torch_native" if on_cpu else "triton" if dtype == "float32" else None)
    if not on_cpu and dtype == "float32" and backend not in FLOAT32_BACKENDS:
        raise ValueError(
            f"rollout.sglang.attention_backend={backend} takes 16-bit weights only, and rollout.dtype serves "
            f"float32 here: use rollout.dtype=bfloat16, or attention_backend {' or '.join(sorted(FLOAT32_BACKENDS))}"
        )
    return backend


def token_versions(meta: dict, count: int) -> list[int]:
    """The weight version of each output token: SGLang's `weight_versions` spans (`start` to `end`, end exclusive,
    over the output tokens) when a refit came in the middle of the request, else its `weight_version`."""
    spans = meta.get("weight_versions")
    if not spans:
        return [int(meta["weight_version"])] * count
    versions = [None] * count
    for span in spans:
        versions[span["start"] : span["end"]] = [int(span["version"])] * (span["end"] - span["start"])
    if None in versions or len(versions) != count:
        raise EngineUnavailable(f"weight_versions spans {spans} do not cover the {count} output tokens")
    return versions


def _sampling_params(request: GenerateRequest) -> dict:
    sampling = request.sampling
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": -1,
        "max_new_tokens": sampling.max_new_tokens,
        "stop_token_ids": list(sampling.stop_token_ids),
        "no_stop_trim": True,  # the stop token stays in the response: the trainer trains on it
        "skip_special_tokens": False,
        "sampling_seed": request.seed,
    }


def _counter(metrics: str, name: str) -> float:
    """A counter's total in Prometheus' text format (`name{labels} value` lines; none yet: 0)."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith((f"{name}{{", f"{name} "))
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """In the server process before exec: SIGKILL it when the process that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
