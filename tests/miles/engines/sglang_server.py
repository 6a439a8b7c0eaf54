"""A stand-in for an SGLang 0.5.23 HTTP server, for tests on machines where SGLang cannot run (it needs a GPU).

`python -m tests.miles.engines.sglang_server --model-path DIR --host 127.0.0.1 --port P ...` takes the launch
flags of `python -m sglang.launch_server` that miles-flow passes, and answers the endpoints SGLangEngine calls
with SGLang's request fields, response JSON and status codes:
- `/generate`: `input_ids` (one list or a batch), `sampling_params` (a dict or one per request), `return_logprob`,
  `lora_path`; each output is `{text, output_ids, meta_info}` with `meta_info.output_token_logprobs` as
  `[logprob, token_id, text-or-null]` triples (and the prompt's, `input_token_logprobs`, from `logprob_start_len`),
  `cached_tokens` (the longest prompt prefix served since the last flush), `finish_reason` `{type: stop, matched}` or `{type: length, length}`,
  and the string `weight_version`. Generation stops on `stop_token_ids` and on every EOS id of the tokenizer,
  `config.json` and `generation_config.json` (unless `ignore_eos`). Without `no_stop_trim`, `output_ids` drop a matched stop token.
- The refit: `/pause_generation` (requests wait until `/continue_generation`), `/flush_cache` (400 while a
  request runs, unless generation is paused in mode retract), `/begin_weight_update` and `/end_weight_update` (a session opened twice, or closed when none is
  open, is refused), `/update_weights_from_disk` (safetensors files; as in SGLang, a tensor name the model lacks
  is skipped with a warning and the load still reports success; the prefix cache is flushed after it unless the
  request says `flush_cache: false`, and a flush it cannot make fails the load), `/get_weights_by_name`.
- `/update_weights_from_tensor` (refused outside a weight-update session): a base64 pickle of (name, tensor) pairs,
  or with `load_format` "flattened_bucket" of one uint8 tensor and a record per tensor (name, shape, dtype, byte
  range) whose bytes SGLang views as each tensor; read by an unpickler that admits tensors, sizes, dtypes and the
  records' SimpleNamespace only, as SGLang's SafeUnpickler (CPU tensors arrive as their bytes).
- The distributed refit: `/init_weights_update_group` joins a real gloo group at `rank_offset` (blocking until every
  rank has joined), `/update_weights_from_distributed` (refused outside a weight-update session) receives rank 0's
  broadcast, per tensor or as one flattened bucket, and loads it by name as a disk load does;
  `/destroy_weights_update_group`.
- `/pause_generation` in mode `abort` (the default) ends the requests in flight with finish reason `abort`; in
  `retract` and `in_place` they wait, and continue on the weights loaded meanwhile: their `meta_info` then carries
  `weight_versions`, spans `{version, start, end}` (end exclusive) over the output tokens.
- `--max-running-requests`: the requests decoded at once (continuous batching, as the TorchEngine does it).
- LoRA (with `--enable-lora`): `/load_lora_adapter` (a name loaded twice is refused), `/unload_lora_adapter`.
- `/release_memory_occupation` and `/resume_memory_occupation` `{tags}` (SGLang's `kv_cache`, `weights`; none: both):
  the engine drops its weights (they come back empty, for the push that follows) as SGLang's memory saver does; a
  release while a request runs takes the server down, as SGLang's scheduler asserts it is idle.
- `/health`, `/health_generate` (a one-token generation; 503 while generation is paused, a weight update is
  open or memory is released, as SGLang cannot run its probe then), `/model_info`.
- `/metrics` (with `--enable-metrics`): `sglang:num_requests_total` and `sglang:generation_tokens_total`, counted
  when a request finishes, in Prometheus' text format.
It generates with a TorchEngine, so tokens and log-probs are real; as SGLang, it honours `sampling_seed` only with
`--enable-deterministic-inference`. `/test_fault` is its own, not SGLang's: it makes every later request answer an
HTTP error, as a server whose scheduler crashed does, every log-prob come back null (`null_logprobs`), or the next
disk, distributed or tensor load take the server down (`die_on_load`), every batch take `generate_delay_s` longer, or
every decode step `decode_delay_s` longer. `/test_decode_steps`, its own too, counts the decode steps run since the
last `/test_fault`, for a test to act at a known point of a generation.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import json
import os
import pickle
import threading
import time
import uuid
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from safetensors.torch import load_file
from transformers import AutoTokenizer

from miles.engines.base import MEMORY_TAGS, GenerateRequest, SamplingParams, eos_token_ids
from miles.engines.torch_engine import TorchEngine
from miles.weights.group import WeightGroup, join, leave, receive_bucket

SGLANG_DEFAULT_SEED = 42  # the sampling_seed SGLang uses when a request sets none


def _version_number(weight_version: str) -> int:
    """The engine counts versions; SGLang's are strings ("default" before any is named)."""
    return int(weight_version) if str(weight_version).isdigit() else 0


def _version_spans(versions: list[int]) -> list[dict]:
    """Runs of equal versions over the output tokens, as SGLang's `weight_versions` (end exclusive)."""
    spans: list[dict] = []
    for position, version in enumerate(versions):
        if spans and spans[-1]["version"] == str(version):
            spans[-1]["end"] = position + 1
        else:
            spans.append({"version": str(version), "start": position, "end": position + 1})
    return spans


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _lora_answer(success: bool, error_message: str, loaded: dict | None) -> JSONResponse:
    body = {
        "rid": None,
        "http_worker_ipc": None,
        "success": success,
        "error_message": error_message,
        "loaded_adapters": dict(loaded) if loaded is not None else None,
    }
    return JSONResponse(body, status_code=200 if success else 400)


class StandInServer:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.engine = TorchEngine(
            args.model_path,
            weight_version=_version_number(args.weight_version),
            device="cpu",
            dtype="float32" if args.dtype == "auto" else args.dtype,
            num_threads=1,
            max_running_requests=args.max_running_requests,
            pause_generation_mode="in_place",  # a load keeps the requests' KV cache; /pause_generation may drop it
        )
        self.tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        self.eos_ids = eos_token_ids(self.tokenizer)
        self.weight_version = args.weight_version
        self.lora_paths: dict[str, str] = {}
        self.in_weight_update = False
        self.released: set[str] = set()  # memory given back by /release_memory_occupation
        self.fault_status: int | None = None
        self.null_logprobs = False  # /test_fault: log-probs come back null, as SGLang may give them
        self.die_on_load = False  # /test_fault: the next weight load takes the server down, as a failed one can
        self.running = 0
        self.abort_epoch = 0  # counts pauses in abort mode: a request that arrived before one ends aborted
        self.generate_delay_s = 0.0
        self.decode_delay_s = 0.0  # /test_fault: every decode step takes this much longer
        self.decode_steps = 0  # since the last /test_fault
        step = self.engine._step

        def counted(admitted):
            time.sleep(self.decode_delay_s)
            step(admitted)
            self.decode_steps += 1

        self.engine._step = counted
        self.weight_groups: dict[str, torch.distributed.ProcessGroup] = {}
        self.cached_prefixes: set[tuple[int, ...]] = set()  # what SGLang's radix cache would hold
        self._paused = False
        self._pause_mode = "abort"
        self._state = threading.Lock()

    def _run(self, requests: list[GenerateRequest]) -> list:
        """The results; requests join the engine's running batch, which a pause holds between decode steps. A pause
        in abort mode while they were in flight ends them aborted."""
        with self._state:
            self.running += 1
            epoch = self.abort_epoch
        try:
            time.sleep(self.generate_delay_s)  # /test_fault: a batch that takes a while, to act on while it runs
            results = self.engine.generate(requests)
        finally:
            with self._state:
                self.running -= 1
        if epoch != self.abort_epoch:
            return [dataclasses.replace(r, finish_reason="abort") for r in results]
        return results

    def load(self, tensors: dict[str, torch.Tensor], weight_version) -> None:
        """As SGLang's load_weights: each tensor goes to its parameter; a name the model does not have is skipped with
        a warning and a parameter the tensors lack keeps its value (the load still succeeds). The engine loads them
        between two decode steps, as `weight_version` when one is given (the server reports it), else as the version
        it held."""
        weights = self.engine.model.state_dict()
        for name, tensor in tensors.items():
            if name in weights:
                weights[name] = tensor
            else:
                print(f"WARNING: Parameter {name} not found in params_dict; skipped", flush=True)
        version = self.weight_version if weight_version is None else weight_version
        self.engine.update_weights(weights, _version_number(version))
        self.weight_version = version

    def generate(self, body: dict) -> JSONResponse:
        ids = body.get("input_ids")
        if ids is None:
            return _error(400, "Either text or input_ids should be provided.")
        single = bool(ids) and isinstance(ids[0], int)
        batch = [ids] if single else ids
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(batch)
        adapters = body.get("lora_path")
        adapters = adapters if isinstance(adapters, list) else [adapters] * len(batch)
        if not (len(params) == len(adapters) == len(batch)):
            return _error(400, "The length of sampling_params and lora_path must match the batch size.")
        if body.get("lora_path") and not self.args.enable_lora:
            first = next((a for a in adapters if a is not None), None)
            return _error(
                400,
                f"LoRA adapter '{first}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint.",
            )
        unknown = [a for a in adapters if a is not None and a not in self.lora_paths]
        if unknown:
            return _error(
                400,
                f"Got LoRA adapter that has never been loaded: {unknown[0]}\n"
                f"All loaded adapters: dict_keys({list(self.lora_paths)}).",
            )
        requests = []
        for prompt, p, adapter in zip(batch, params, adapters, strict=True):
            if p.get("top_k", -1) != -1 or p.get("n", 1) != 1:
                return _error(400, "this stand-in server supports top_k=-1 and n=1 only")
            sampling = SamplingParams(
                temperature=p.get("temperature", 1.0),
                top_p=p.get("top_p", 1.0),
                max_new_tokens=p.get("max_new_tokens", 128),
                # SGLang also stops on every EOS id of the model's files, unless the request ignores EOS.
                stop_token_ids=tuple(dict.fromkeys([*(p.get("stop_token_ids") or ()), *self.stops_on_eos(p)])),
            )
            requests.append(
                GenerateRequest(
                    prompt_ids=list(prompt),
                    sampling=sampling,
                    adapter=adapter,
                    seed=p.get("sampling_seed", SGLANG_DEFAULT_SEED)
                    if self.args.enable_deterministic_inference
                    else int.from_bytes(os.urandom(4), "little"),  # without it SGLang's sampling is not seeded
                )
            )
        started = time.perf_counter()
        cached = [self.cached_tokens(r.prompt_ids) for r in requests]
        results = self._run(requests)
        for request, result in zip(requests, results, strict=True):
            sequence = (*request.prompt_ids, *result.output_ids)
            self.cached_prefixes.update(sequence[:end] for end in range(1, len(sequence) + 1))
        outputs = [
            self._output(r, q, p, body, started, c)
            for r, q, p, c in zip(results, requests, params, cached, strict=True)
        ]
        return JSONResponse(outputs[0] if single else outputs)

    def prompt_logprobs(self, prompt: list[int], start: int) -> list[list]:
        """`input_token_logprobs` from position `start` on (none for SGLang's default -1); the first token has no
        log-prob."""
        if start < 0:
            return []
        scored = [None, *self.engine.sequence_logprobs(prompt)]
        return [[lp, token, None] for lp, token in zip(scored, prompt, strict=True)][start:]

    def cached_tokens(self, prompt: list[int]) -> int:
        """The prompt's longest cached prefix, short of its last token (whose logits a request needs)."""
        return max((end for end in range(len(prompt)) if tuple(prompt[:end]) in self.cached_prefixes), default=0)

    def flush_cache(self) -> bool:
        """As SGLang's flush: refused while a request runs, unless generation is paused in mode retract (the
        requests then wait in the queue, which a paused server's flush ignores)."""
        if self.running and not (self._paused and self._pause_mode == "retract"):
            return False
        self.cached_prefixes.clear()
        return True

    def flushed_after_load(self, body: dict) -> JSONResponse | None:
        """The failure SGLang answers when a load asked for a flush it could not make; None when all is well."""
        if body.get("flush_cache", True) and not self.flush_cache():
            message = (
                "Weights were updated, but the cache was not flushed because requests are still running or queued. "
                "Retract or finish them, then call /flush_cache."
            )
            return JSONResponse({"success": False, "message": message}, status_code=400)
        return None

    def stops_on_eos(self, params: dict) -> tuple[int, ...]:
        return () if params.get("ignore_eos", False) else self.eos_ids

    def _output(self, result, request: GenerateRequest, params: dict, body: dict, started: float, cached: int) -> dict:
        if result.finish_reason == "abort":
            finish = {"type": "abort", "message": "Abort in running batch.", "status_code": 503}
            output_ids = result.output_ids
        elif result.finish_reason == "stop":
            finish = {"type": "stop", "matched": result.output_ids[-1]}
            output_ids = result.output_ids if params.get("no_stop_trim", False) else result.output_ids[:-1]
        else:
            finish = {"type": "length", "length": len(result.output_ids)}
            output_ids = result.output_ids
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(request.prompt_ids),
            # the version when the request finished, as SGLang stamps it (a batch answers once all have)
            "weight_version": str(result.weight_versions[-1]) if result.weight_versions else self.weight_version,
            "completion_tokens": len(result.output_ids),
            "cached_tokens": cached,
            "e2e_latency": time.perf_counter() - started,
        }
        meta["weight_versions"] = _version_spans(result.weight_versions)
        if body.get("return_logprob", False):
            meta["output_token_logprobs"] = [
                [None if self.null_logprobs else lp, token, None]
                for lp, token in zip(result.logprobs, result.output_ids, strict=True)
            ]
            meta["input_token_logprobs"] = self.prompt_logprobs(request.prompt_ids, body.get("logprob_start_len", -1))
        text = self.tokenizer.decode(output_ids, skip_special_tokens=params.get("skip_special_tokens", True))
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    def release_memory(self, tags: list[str] | None) -> None:
        if self.running:  # SGLang's scheduler asserts it is idle, and dies
            print("AssertionError: release_memory_occupation should be called only when server is idle.", flush=True)
            os._exit(1)
        self.engine.release_memory(tags or MEMORY_TAGS)
        self.released.update(tags or MEMORY_TAGS)

    def resume_memory(self, tags: list[str] | None) -> None:
        self.engine.resume_memory(tags or MEMORY_TAGS)
        self.released.difference_update(tags or MEMORY_TAGS)

    def health_generate(self) -> Response:
        if self._paused or self.in_weight_update or self.released:  # SGLang cannot run its probe
            return Response(status_code=503)
        if self.running:  # busy generating is alive
            return Response(status_code=200)
        probe = GenerateRequest(prompt_ids=[0], sampling=SamplingParams(max_new_tokens=1))
        self.engine.generate([probe])
        return Response(status_code=200)

    def pause(self, mode: str) -> None:
        """abort: the requests in flight end as aborted; retract and in_place: they wait (their KV cache dropped or
        kept). Either way new ones wait for /continue_generation."""
        with self._state:
            if mode == "abort":
                self.abort_epoch += 1
            if not self._paused:
                self.engine.pause_generation(mode)
                self._paused, self._pause_mode = True, mode
            elif mode == "abort":
                self.engine.pause_generation(mode)
                self.engine.continue_generation()

    def resume(self) -> None:
        with self._state:
            if self._paused:
                self.engine.continue_generation()
                self._paused = False

    def update_from_disk(self, body: dict) -> JSONResponse:
        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            return JSONResponse(
                {
                    "success": False,
                    "message": f"Failed to update weights: no safetensors in {body['model_path']}",
                    "num_paused_requests": 0,
                },
                status_code=400,
            )
        if self.die_on_load:  # SGLang switched its model path before the load failed: the server goes down
            print("ERROR: Failed to load the weights; the scheduler exits", flush=True)
            os._exit(1)
        try:
            self.load({name: t for f in files for name, t in load_file(f).items()}, body.get("weight_version"))
        except Exception as exc:  # noqa: BLE001 - SGLang answers a failed load, it does not crash
            return JSONResponse(
                {
                    "success": False,
                    "message": f"Failed to update weights: {exc}.\nRolling back to original weights.",
                    "num_paused_requests": 0,
                },
                status_code=400,
            )
        refused = self.flushed_after_load(body)
        if refused is not None:
            return refused
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            message += f" Weight version updated to {self.weight_version}."
        return JSONResponse({"success": True, "message": message, "num_paused_requests": 0})

    def update_from_tensor(self, body: dict) -> JSONResponse:
        """As SGLang's: refused outside a weight-update session; the payload is read by an unpickler that admits
        tensors and their storage only (SGLang's SafeUnpickler; a CPU tensor arrives as its bytes)."""
        if not self.in_weight_update:
            message = "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
            return JSONResponse({"success": False, "message": message}, status_code=400)
        if self.die_on_load:  # a bucket SGLang's scheduler cannot open raises with no handler there: it exits
            print("ERROR: the scheduler died loading a tensor bucket", flush=True)
            os._exit(1)
        try:
            payload = TensorsOnly(io.BytesIO(base64.b64decode(body["serialized_named_tensors"][0]))).load()
            self.load(_named_tensors(payload, body.get("load_format")), body.get("weight_version"))
        except Exception as exc:  # noqa: BLE001 - SGLang answers a failed update
            return JSONResponse({"success": False, "message": f"Failed to update weights: {exc}"}, status_code=400)
        return self.flushed_after_load(body) or JSONResponse({"success": True, "message": "Success"})

    def init_weights_group(self, body: dict) -> JSONResponse:
        group = WeightGroup(
            master_address=body["master_address"],
            master_port=body["master_port"],
            world_size=body["world_size"],
            group_name=body.get("group_name", "weight_update_group"),
            backend=body.get("backend", "nccl"),
            timeout_s=600.0,
        )
        try:
            self.weight_groups[group.group_name] = join(group, rank=body["rank_offset"])
        except Exception as exc:  # noqa: BLE001 - SGLang answers a failed init
            message = f"Failed to initialize custom process group: {exc}."
            return JSONResponse({"success": False, "message": message}, status_code=400)
        return JSONResponse({"success": True, "message": "Succeeded to initialize custom process group."})

    def update_from_distributed(self, body: dict) -> JSONResponse:
        if not self.in_weight_update:
            message = "no weight-update session is open; call begin_weight_update() first"
            return JSONResponse({"success": False, "message": message}, status_code=400)
        group_name = body.get("group_name", "weight_update_group")
        if group_name not in self.weight_groups:
            message = (
                f"Group {group_name} not in {list(self.weight_groups)}. Please call `init_weights_update_group` first."
            )
            return JSONResponse({"success": False, "message": message}, status_code=400)
        if self.die_on_load:
            print("ERROR: the scheduler died receiving weights", flush=True)
            os._exit(1)
        specs = list(zip(body["names"], body["dtypes"], body["shapes"], strict=True))
        try:
            group = self.weight_groups[group_name]
            tensors = receive_bucket(group, specs, torch.device("cpu"), body.get("load_format"))
            self.load(tensors, body.get("weight_version"))
        except Exception as exc:  # noqa: BLE001 - SGLang answers a failed update
            message = (
                f"Failed to update parameter online: {exc}. The full weights of the ModelRunner are partially "
                "updated. Please discard the whole weights."
            )
            return JSONResponse({"success": False, "message": message}, status_code=400)
        return self.flushed_after_load(body) or JSONResponse(
            {"success": True, "message": "Succeeded to update parameter online."}
        )

    def destroy_weights_group(self, body: dict) -> JSONResponse:
        group = self.weight_groups.pop(body.get("group_name", "weight_update_group"), None)
        if group is None:
            return JSONResponse({"success": False, "message": "Group not found."}, status_code=400)
        leave(group)
        return JSONResponse({"success": True, "message": "Succeeded to destroy custom process group."})

    def weights_by_name(self, body: dict) -> JSONResponse:
        """The first `truncate_size` rows of a parameter as float32 lists (SGLang's model.get_weights_by_name)."""
        parameters = self.engine.model.state_dict()
        name = body.get("name")
        if name not in parameters:
            print(f"ERROR: Error when getting parameter {name}: {name!r}", flush=True)
            return _error(400, "Get parameter by name failed")
        with self.engine.paused("in_place"):
            rows = parameters[name].detach().to(torch.float32).tolist()
        return JSONResponse(rows[: body.get("truncate_size", 100)])

    def check_weights(self, body: dict) -> JSONResponse:
        """SGLang's `/weights_checker` with action checksum: a digest of every weight (the others are not played)."""
        if body.get("action", "checksum") != "checksum":
            return JSONResponse({"success": False, "message": f"Unsupported action={body['action']!r}"}, 400)
        checksum = self.engine.weights_checksum()
        return JSONResponse({"success": True, "message": "Success.", "ranks": [], "per_engine_checksum": checksum})

    def load_lora(self, body: dict) -> JSONResponse:
        name, path = body["lora_name"], body["lora_path"]
        if not self.args.enable_lora:
            return _lora_answer(False, "LoRA is not enabled. Please set `--enable-lora` to enable LoRA.", None)
        if name in self.lora_paths:
            return _lora_answer(
                False, f"Failed to load LoRA adapter {name} because it is already loaded", self.lora_paths
            )
        config = json.loads((Path(path) / "adapter_config.json").read_text())
        if config["r"] > self.args.max_lora_rank:
            return _lora_answer(
                False,
                f"LoRA adapter {name} with rank {config['r']} is incompatible with the current LoRA "
                f"memory pool configuration (max_lora_rank {self.args.max_lora_rank}).",
                self.lora_paths,
            )
        targets = set(config["target_modules"])
        if not targets <= set(self.args.lora_target_modules or ()):
            return _lora_answer(
                False,
                f"LoRA adapter {name} targets {sorted(targets)}, incompatible with the current LoRA "
                f"memory pool configuration ({self.args.lora_target_modules}).",
                self.lora_paths,
            )
        try:
            tensors = load_file(Path(path) / "adapter_model.safetensors")
            self.engine.load_adapter(name, tensors, config, 0)
        except Exception as exc:  # noqa: BLE001 - SGLang answers a failed load, it does not crash
            return _lora_answer(False, f"Failed to load LoRA adapter {name}: {exc}", self.lora_paths)
        self.lora_paths[name] = path
        return _lora_answer(True, "", self.lora_paths)

    def unload_lora(self, body: dict) -> JSONResponse:
        name = body["lora_name"]
        if name not in self.lora_paths:
            return _lora_answer(
                False,
                f"LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({list(self.lora_paths)})",
                self.lora_paths,
            )
        self.engine.unload_adapter(name)
        del self.lora_paths[name]
        return _lora_answer(True, "", self.lora_paths)


class TensorsOnly(pickle.Unpickler):
    """Unpickles tensors, sizes, dtypes and SimpleNamespace records and nothing else: a tensor's bytes go through
    torch's weights-only loader."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return lambda data: torch.load(io.BytesIO(data), weights_only=True)
        if (
            module == "torch._utils"
            and name in ("_rebuild_tensor", "_rebuild_tensor_v2")
            or (module, name) in (("collections", "OrderedDict"), ("types", "SimpleNamespace"), ("torch", "Size"))
            or module == "torch"
            and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not a tensor")


def _named_tensors(payload, load_format: str | None) -> dict[str, torch.Tensor]:
    """The tensors of an `/update_weights_from_tensor` payload, as SGLang reads it by its load_format."""
    if load_format is None:
        return dict(payload)
    if load_format == "flattened_bucket":
        flat = payload["flattened_tensor"]
        return {
            record.name: flat[record.start_idx : record.end_idx].view(record.dtype).reshape(record.shape)
            for record in payload["metadata"]
        }
    raise NotImplementedError(f"Unknown load_format={load_format}")


def build_app(server: StandInServer) -> FastAPI:
    app = FastAPI()

    @app.middleware("http")
    async def injected_fault(request: Request, call_next):
        if server.fault_status is not None and request.url.path != "/test_fault":
            return _error(server.fault_status, "scheduler process died (injected by /test_fault)")
        return await call_next(request)

    @app.post("/test_fault")
    def test_fault(body: dict):
        server.fault_status = body.get("status")
        server.null_logprobs = body.get("null_logprobs", False)
        server.die_on_load = body.get("die_on_load", False)
        server.generate_delay_s = body.get("generate_delay_s", 0.0)
        server.decode_delay_s = body.get("decode_delay_s", 0.0)  # so that a push can land in a generation's middle
        server.decode_steps = 0
        return {"success": True}

    @app.get("/test_decode_steps")
    def test_decode_steps():
        return {"decode_steps": server.decode_steps}

    @app.get("/health")
    def health():
        return Response(status_code=200)

    @app.get("/metrics")
    def metrics():
        if not server.args.enable_metrics:
            return Response(status_code=404)
        progress = server.engine.progress()
        labels = '{model_name="stand-in",is_streaming="false"}'
        return PlainTextResponse(
            f"sglang:num_requests_total{labels} {float(progress.requests_finished)}\n"
            f"sglang:generation_tokens_total{labels} {float(progress.tokens_generated)}\n"
        )

    @app.get("/health_generate")
    def health_generate():
        return server.health_generate()

    @app.get("/model_info")
    def model_info():
        return {
            "model_path": server.args.model_path,
            "tokenizer_path": server.args.model_path,
            "is_generation": True,
            "weight_version": server.weight_version,
        }

    @app.api_route("/generate", methods=["POST", "PUT"])
    def generate(body: dict):
        return server.generate(body)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache():
        if not server.flush_cache():
            return PlainTextResponse("Flush cache failed.\n", status_code=400)
        return PlainTextResponse(
            "Cache flushed.\nPlease check backend logs for more details. (When there are running or "
            "waiting requests, the operation will not be performed.)\n"
        )

    @app.post("/pause_generation")
    def pause_generation(body: dict):
        server.pause(body.get("mode", "abort"))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    def continue_generation(body: dict):
        server.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/begin_weight_update")
    def begin_weight_update(body: dict):
        if server.in_weight_update:
            return JSONResponse(
                {"success": False, "message": "a weight update session is already open"}, status_code=400
            )
        server.in_weight_update = True
        return {"success": True, "message": "Success"}

    @app.post("/end_weight_update")
    def end_weight_update(body: dict):
        if not server.in_weight_update:
            return JSONResponse({"success": False, "message": "No weight update session in progress."}, status_code=400)
        server.in_weight_update = False
        return {"success": True, "message": "Success"}

    @app.post("/update_weights_from_disk")
    def update_weights_from_disk(body: dict):
        return server.update_from_disk(body)

    @app.post("/update_weights_from_tensor")
    def update_weights_from_tensor(body: dict):
        return server.update_from_tensor(body)

    @app.post("/init_weights_update_group")
    def init_weights_update_group(body: dict):
        return server.init_weights_group(body)

    @app.post("/update_weights_from_distributed")
    def update_weights_from_distributed(body: dict):
        return server.update_from_distributed(body)

    @app.post("/destroy_weights_update_group")
    def destroy_weights_update_group(body: dict):
        return server.destroy_weights_group(body)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    def get_weights_by_name(body: dict):
        return server.weights_by_name(body)

    @app.api_route("/weights_checker", methods=["GET", "POST"])
    def weights_checker(body: dict):
        return server.check_weights(body)

    @app.post("/release_memory_occupation")
    def release_memory_occupation(body: dict):
        server.release_memory(body.get("tags"))
        return {}

    @app.post("/resume_memory_occupation")
    def resume_memory_occupation(body: dict):
        server.resume_memory(body.get("tags"))
        return {}

    @app.post("/load_lora_adapter")
    def load_lora_adapter(body: dict):
        return server.load_lora(body)

    @app.post("/unload_lora_adapter")
    def unload_lora_adapter(body: dict):
        return server.unload_lora(body)

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--device", default="cpu", choices=["cpu"])
    parser.add_argument("--tp-size", type=int, default=1, choices=[1])
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    parser.add_argument("--enable-metrics", action="store_true")
    parser.add_argument("--attention-backend")
    parser.add_argument("--max-total-tokens", type=int)
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-lora-rank", type=int)
    parser.add_argument("--lora-target-modules", nargs="+")
    parser.add_argument("--max-loras-per-batch", type=int, default=8)
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--max-running-requests", type=int)
    parser.add_argument("--sleep-on-idle", action="store_true")
    args = parser.parse_args()
    if args.enable_deterministic_inference and args.attention_backend == "torch_native":
        parser.error("--enable-deterministic-inference is not supported with --attention-backend torch_native")
    torch.manual_seed(0)
    server = StandInServer(args)
    uvicorn.run(build_app(server), host=args.host, port=args.port, log_level="info", access_log=True)


if __name__ == "__main__":
    main()
