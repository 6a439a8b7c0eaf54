"""SGLang's own rules for what this project sends it, checked by SGLang's own code: run by the Python of SGLang's
environment (`python tests/helpers/sglang_rules.py < input.json`), never imported by the project.

Input on stdin, one JSON object:
  {"launches": [argv, ...],                 each argv what follows `python -m sglang.launch_server`
   "requests": [[endpoint, body], ...],     each body a JSON object the engine POSTs to the endpoint
   "vocab_size": int}                       the served model's, for SGLang's sampling-parameter range checks
Output: one JSON object on the last line of stdout (SGLang's own logs go to stderr), in the input's order:
  {"launches": [{"argv", "ok", "resolved": {field: value} or null, "error": text or null}, ...],
   "requests": [{"endpoint", "request_class", "ok", "error"}, ...]}, a tensor update's with "tensors" too: each
   tensor SGLang reads from it, {name: [dtype, shape, sum]}

A launch goes the way `python -m sglang.launch_server` takes its argv before it starts any process:
`prepare_server_args(argv)` (its argparse parser and ServerArgs), `ServerArgs.resolve_once()` (the resolution
pipeline `run_server` calls: SGLang's defaults and its validation hooks) and `ServerArgs.check_server_args()` (what
`Engine._launch_subprocesses` checks next). `resolved` is read from `ServerArgs.resolved_dict()`, the values the
server then runs with. Each launch is resolved in a process of its own, forked after SGLang is imported (resolution
sets environment variables and other process-wide state). `--device cpu` launches come from a process that imported
SGLang with SGLANG_USE_CPU_ENGINE=1, as SGLangEngine starts a CPU server, on this machine as it is; the others from
one that imported it without, and see the GPU of `install_h100` below, the one place this script stands in for a
device.

A request goes the way SGLang's HTTP server takes its body: the POST route of `sglang.srt.entrypoints.http_server`'s
app for the endpoint, its FastAPI body field's own validation into SGLang's request class (from
`sglang.srt.managers.io_struct`), then what the server does before the request reaches its scheduler: for
GenerateReqInput, the `/generate` JSON contract gate (`generate_contract_error`), `normalize_batch_and_arguments()`
and, for each request of the batch, SGLang's SamplingParams built from its `sampling_params` with `normalize` and
`verify`, as its TokenizerManager does. A body field the class does not have is an error here: the server silently
ignores it, so a field SGLang renamed or dropped would otherwise go unnoticed.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import json
import os
import sys
import traceback
import typing
from types import SimpleNamespace

# What each launch reports: the values the project's engine relies on, and the flags it sends.
RESOLVED_FIELDS = (
    "attention_backend",
    "dtype",
    "enable_deterministic_inference",
    "mem_fraction_static",
    "tp_size",
    "sleep_on_idle",
    "weight_version",
    "host",
    "port",
    "device",
    "max_total_tokens",
    "max_running_requests",
    "enable_metrics",
    "enable_lora",
    "max_lora_rank",
    "max_loras_per_batch",
    "lora_target_modules",
    "enable_memory_saver",
)
NO_FIELD = "(ServerArgs has no such field)"


# ---- The GPU: what one H100 80GB answers, the one place this script stands in for a device ----------------------
H100_NAME = "NVIDIA H100 80GB HBM3"
H100_CAPABILITY = (9, 0)
H100_MEMORY_MIB = 81559  # nvidia-smi's memory.total of an H100 80GB HBM3
H100_MULTIPROCESSORS = 132


def install_h100(device_count: int) -> None:
    """Make this process's device queries answer as `device_count` idle H100 80GB GPUs: torch.cuda's queries, and
    SGLang's nvidia-smi query of the memory (get_nvgpu_memory_capacity); SGLang's cached probes (`is_cuda`,
    `is_sm90_supported`, `is_hopper_with_cuda_12_3`, ... in sglang.srt.utils.common, which its platform facts read)
    are cleared so that they ask again. Installed after SGLang's modules are imported, so that the kernels they load
    at import are this machine's (the CPU ones this environment has), and before the launch is resolved."""
    import torch
    from sglang.srt.utils import common

    total = H100_MEMORY_MIB * 2**20
    properties = SimpleNamespace(
        name=H100_NAME,
        major=H100_CAPABILITY[0],
        minor=H100_CAPABILITY[1],
        total_memory=total,
        multi_processor_count=H100_MULTIPROCESSORS,
    )
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: device_count
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: H100_CAPABILITY
    torch.cuda.get_device_name = lambda device=None: H100_NAME
    torch.cuda.get_device_properties = lambda device=None: properties
    torch.cuda.mem_get_info = lambda device=None: (total - 2**29, total)  # free, total: a CUDA context's 512 MiB used
    common.get_nvgpu_memory_capacity = lambda: float(H100_MEMORY_MIB)
    for probe in list(vars(common).values()):
        if callable(getattr(probe, "cache_clear", None)):
            probe.cache_clear()


# ---- Launches ------------------------------------------------------------------------------------------------------
def device_of(argv: list[str]) -> str:
    for i, arg in enumerate(argv):
        if arg == "--device" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--device="):
            return arg.split("=", 1)[1]
    return "cuda"  # none named: SGLang takes the GPU of a GPU server


def resolve_launch(argv: list[str], on_gpu: bool) -> dict:
    from sglang.srt.server_args import compute_world_size, prepare_server_args

    parse_errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(parse_errors):
            server_args = prepare_server_args(list(argv))
    except SystemExit:  # argparse refused the command line and said why on stderr
        lines = parse_errors.getvalue().strip().splitlines()
        return _launch(argv, error=lines[-1] if lines else "the command line was refused")
    try:
        if on_gpu:
            sizes = dict(dp_size=server_args.dp_size, tp_size=server_args.tp_size, pp_size=server_args.pp_size)
            install_h100(compute_world_size(**sizes))
        server_args.resolve_once()
        server_args.check_server_args()
        resolved = server_args.resolved_dict()
    except BaseException as exc:  # noqa: BLE001 - SGLang's refusal is the result
        traceback.print_exc()
        return _launch(argv, error=_error_text(exc))
    return _launch(argv, resolved={name: _plain(resolved.get(name, NO_FIELD)) for name in RESOLVED_FIELDS})


def _launch(argv: list[str], resolved: dict | None = None, error: str | None = None) -> dict:
    return {"argv": argv, "ok": error is None, "resolved": resolved, "error": error}


def resolve_launches(argvs: list[list[str]], on_gpu: bool) -> list[dict]:
    """In a process of its own: import SGLang as its launcher does, then resolve each argv in a fork."""
    import sglang.srt.arg_groups.pipeline  # noqa: F401 - resolution's modules, imported before any GPU is installed
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return [_forked(resolve_launch, argv, on_gpu) or _launch(argv, error="the process crashed") for argv in argvs]


# ---- Requests ------------------------------------------------------------------------------------------------------
def check_request(endpoint: str, body: dict, vocab_size: int) -> dict:
    from sglang.srt.entrypoints import http_server

    route = next(
        (r for r in http_server.app.routes if getattr(r, "path", None) == endpoint and "POST" in r.methods), None
    )
    if route is None:
        return _request(endpoint, None, f"SGLang's HTTP server has no POST {endpoint}")
    field = getattr(route, "body_field", None)
    if field is None:
        error = f"POST {endpoint} reads no JSON body: the server ignores {sorted(body)}" if body else None
        return _request(endpoint, None, error)
    request_class = _request_class(field.field_info.annotation)
    name = request_class.__name__ if request_class else repr(field.field_info.annotation)
    try:
        value, errors = field.validate(copy.deepcopy(body), {}, loc=("body",))
        if errors:
            return _request(endpoint, name, f"the server's body validation refused it: {_validation_text(errors)}")
        unknown = sorted(set(body) - _field_names(request_class))
        if unknown:
            return _request(endpoint, name, f"{name} has no field {', '.join(unknown)} (the server ignores them)")
        from sglang.srt.managers.io_struct import GenerateReqInput

        if isinstance(value, GenerateReqInput):
            _check_generate(body, value, vocab_size)
        verdict = _request(endpoint, name, None)
        if endpoint == "/update_weights_from_tensor":
            verdict["tensors"] = _tensors_read(value)
    except BaseException as exc:  # noqa: BLE001 - SGLang's refusal is the result
        traceback.print_exc()
        return _request(endpoint, name, _error_text(exc))
    return verdict


def _tensors_read(request) -> dict[str, list]:
    """The tensors of an /update_weights_from_tensor request as SGLang's scheduler reads them on TP rank 0
    (`deserialize_own_rank`: its MultiprocessingSerializer, with its SafeUnpickler), then its model runner (a
    flattened bucket rebuilt as `_update_weights_from_flattened_bucket` does), each as [dtype, shape, sum]."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata

    payload = MultiprocessingSerializer.deserialize(request.serialized_named_tensors[0])
    if request.load_format == "flattened_bucket":
        metadata = [
            FlattenedTensorMetadata(
                name=m.name, shape=m.shape, dtype=m.dtype, start_idx=m.start_idx, end_idx=m.end_idx, numel=m.numel
            )
            for m in payload["metadata"]
        ]
        named = FlattenedTensorBucket(flattened_tensor=payload["flattened_tensor"], metadata=metadata)
        payload = named.reconstruct_tensors()
    return {name: [str(t.dtype), list(t.shape), float(t.double().sum())] for name, t in payload}


def _check_generate(body: dict, request, vocab_size: int) -> None:
    """What the server does to a /generate body before its scheduler sees it (http_server.generate_request and its
    TokenizerManager's normalization and sampling-parameter checks)."""
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.sampling.sampling_params import SamplingParams

    contract_error = generate_contract_error(body)
    if contract_error is not None:
        raise ValueError(f"the /generate contract gate refused it: {contract_error}")
    request.normalize_batch_and_arguments()
    for item in [request] if request.is_single else [request[i] for i in range(request.batch_size)]:
        sampling = SamplingParams(**dict(item.sampling_params))
        sampling.normalize(None)
        sampling.verify(vocab_size)


def _validation_text(errors: list[dict]) -> str:
    """FastAPI's errors, less the union branch that only says a dict is not already the request class."""
    reasons = [e for e in errors if e.get("type") != "is_instance_of"] or errors
    return "; ".join(f"{e.get('msg')} (field {'.'.join(str(p) for p in e.get('loc', ())[2:]) or '-'})" for e in reasons)


def _request_class(annotation) -> type | None:
    """The request class of a body annotation (`X`, or `Optional[X]` as /weights_checker takes)."""
    if isinstance(annotation, type):
        return annotation
    classes = [a for a in typing.get_args(annotation) if isinstance(a, type) and a is not type(None)]
    return classes[0] if len(classes) == 1 else None


def _field_names(request_class: type | None) -> set[str]:
    if request_class is None:
        return set()
    if dataclasses.is_dataclass(request_class):
        return {f.name for f in dataclasses.fields(request_class)}
    import msgspec

    return {f.name for f in msgspec.structs.fields(request_class)}


def _request(endpoint: str, request_class: str | None, error: str | None) -> dict:
    return {"endpoint": endpoint, "request_class": request_class, "ok": error is None, "error": error}


def check_requests(requests: list, vocab_size: int) -> list[dict]:
    return [check_request(endpoint, body, vocab_size) for endpoint, body in requests]


# ---- Processes -----------------------------------------------------------------------------------------------------
def _cpu_side(argvs: list[list[str]], requests: list, vocab_size: int) -> dict:
    """SGLang imported as SGLangEngine starts a CPU server: the CPU launches, then the requests."""
    os.environ["SGLANG_USE_CPU_ENGINE"] = "1"
    launches = resolve_launches(argvs, on_gpu=False)
    return {"launches": launches, "requests": check_requests(requests, vocab_size)}


def _gpu_side(argvs: list[list[str]]) -> dict:
    os.environ.pop("SGLANG_USE_CPU_ENGINE", None)
    return {"launches": resolve_launches(argvs, on_gpu=True)}


def _start(fn, *args) -> tuple[int, int]:
    """Fork a process that runs fn(*args) and writes its JSON result to a pipe; its stdout goes to stderr."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        os.dup2(2, 1)
        try:
            payload = json.dumps(fn(*args), default=str)
        except BaseException:  # noqa: BLE001 - reported to the parent
            payload = json.dumps({"crash": traceback.format_exc()})
        with os.fdopen(write_end, "w") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_end)
    return pid, read_end


def _finish(started: tuple[int, int]):
    pid, read_end = started
    with os.fdopen(read_end) as pipe:
        data = pipe.read()
    os.waitpid(pid, 0)
    result = json.loads(data) if data else None
    if isinstance(result, dict) and "crash" in result:
        raise RuntimeError(f"a checking process failed:\n{result['crash']}")
    return result


def _forked(fn, *args):
    return _finish(_start(fn, *args))


def _error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _plain(value):
    """A resolved value as JSON: a set (lora_target_modules) as a sorted list."""
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return json.loads(json.dumps(value, default=str))


def main() -> None:
    import torch  # noqa: F401 - imported once, before the two sides fork; SGLang itself only in each side

    task = json.load(sys.stdin)
    argvs = [list(argv) for argv in task.get("launches", [])]
    on_cpu = [device_of(argv).split(":")[0] == "cpu" for argv in argvs]
    cpu_argvs = [argv for argv, cpu in zip(argvs, on_cpu, strict=True) if cpu]
    gpu_argvs = [argv for argv, cpu in zip(argvs, on_cpu, strict=True) if not cpu]
    # The two sides import SGLang in different states, so each in a process of its own, side by side.
    cpu = _start(_cpu_side, cpu_argvs, task.get("requests", []), int(task.get("vocab_size", 32000)))
    gpu = _start(_gpu_side, gpu_argvs) if gpu_argvs else None
    cpu_result = _finish(cpu)
    gpu_launches = iter(_finish(gpu)["launches"] if gpu else [])
    cpu_launches = iter(cpu_result["launches"])
    launches = [next(cpu_launches) if cpu else next(gpu_launches) for cpu in on_cpu]
    print(json.dumps({"launches": launches, "requests": cpu_result["requests"]}))


if __name__ == "__main__":
    main()
