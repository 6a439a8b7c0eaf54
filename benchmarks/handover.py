"""Rollout handover: a dict of Python lists vs an Arrow rollout table, from a producer actor to a consumer actor.

One Ray actor (the producer, standing for the rollout side) hands a rollout of N samples x 256 response tokens
(prompts of 24-40 tokens, 32 on average; groups of 8 samples share a prompt) to another Ray actor (the
consumer, standing for the trainer), which turns it into padded training tensors: tokens, attention mask, loss
(response) mask, rollout log-probs, advantages. Both sides carry the same tokens, log-probs, masks and rewards.

(a) lists, the layout of miles' train data: a dict of parallel Python lists (`tokens` = prompt + response ids,
    `response_lengths`, `rewards` (the normalised advantage), `raw_reward`, `truncated`, `sample_indices`,
    `loss_masks`, `rollout_log_probs`). The producer `ray.put`s it (cloudpickle of the lists into the object
    store); the consumer `ray.get`s it (unpickling every int and float) and builds the tensors the usual way:
    one `torch.tensor` per sample and field, left-padding of the response fields by the prompt length, then
    `pad_sequence`.
(b) table, the handover of `RolloutExecutor.get`: a `pyarrow.Table` with ROLLOUT_SCHEMA whose list columns are
    offsets + values buffers. The producer `ray.put`s it (the buffers go out of band, one memcpy each into the
    object store); the consumer `ray.get`s it (zero-copy views of the shared memory) and builds the tensors with
    `miles.train.batch.batch_from_table`.

Each measurement runs from "the producer holds the payload" (built beforehand, not timed) to "the consumer holds
the tensors": put + hand the reference over through the driver + get + convert. Timestamps are taken in the two
actor processes with the machine-wide monotonic clock. Each measurement uses a fresh consumer actor, so that its
memory figure, peak RSS (VmHWM) minus RSS before receiving, starts from a clean process. Per size: one warm-up
pair, then `--repeats` pairs alternating (a) and (b); the figures are medians. The warm-up pair of the smallest
size also checks that both sides produce equal tensors.

Last line: `handover_speedup <(a) seconds / (b) seconds at the largest size>`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import ray
import torch

from benchmarks.smoke import parse_args
from miles.cluster.actors import actor_options
from miles.rollout.schema import ROLLOUT_SCHEMA, STATUSES, with_rollout_metadata
from miles.train.algorithms.advantages import grpo

RESPONSE_TOKENS = 256
PROMPT_TOKENS = (24, 40)  # inclusive range, 32 on average
GROUP = 8
VOCAB = 32000
PAD = 0
MIB = 1024 * 1024


def _proc_status_kib(*keys: str) -> dict[str, int]:
    values = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, rest = line.partition(":")
            if name in keys:
                values[name] = int(rest.split()[0])
    return values


def _reset_peak_rss() -> None:
    try:  # Linux >= 4.0: VmHWM := VmRSS; a fresh actor is the fallback where this is not allowed
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        pass


def make_rollout(samples: int, seed: int) -> dict[str, np.ndarray]:
    """The rollout as flat numpy arrays: list fields as offsets + values."""
    rng = np.random.default_rng(seed)
    groups = -(-samples // GROUP)
    group_prompt_len = rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, groups)
    group_offsets = np.concatenate([[0], np.cumsum(group_prompt_len)])
    group_prompts = rng.integers(1, VOCAB, group_offsets[-1], dtype=np.int32)
    group_of = np.arange(samples) // GROUP
    prompt_len = group_prompt_len[group_of]
    prompt_offsets = np.concatenate([[0], np.cumsum(prompt_len)]).astype(np.int32)
    # Each sample's prompt: its group's prompt tokens, gathered without a Python loop.
    within = np.arange(prompt_offsets[-1]) - np.repeat(prompt_offsets[:-1], prompt_len)
    prompt_values = group_prompts[np.repeat(group_offsets[group_of], prompt_len) + within]
    response_len = np.full(samples, RESPONSE_TOKENS, dtype=np.int32)
    response_offsets = np.concatenate([[0], np.cumsum(response_len)]).astype(np.int32)
    tokens = int(response_offsets[-1])
    raw_reward = rng.integers(0, 2, samples).astype(np.float32)
    scores = torch.from_numpy(raw_reward.astype(np.float64))
    lengths = torch.from_numpy(response_len.astype(np.float64))
    return {
        "group_index": group_of.astype(np.int64),
        "prompt_offsets": prompt_offsets,
        "prompt_values": prompt_values,
        "response_offsets": response_offsets,
        "response_values": rng.integers(1, VOCAB, tokens, dtype=np.int32),
        "response_length": response_len,
        "logprobs": (-rng.exponential(0.5, tokens)).astype(np.float32),
        "loss_mask": (rng.random(tokens) < 0.95).astype(np.int8),
        "raw_reward": raw_reward,
        "advantage": grpo(scores, torch.from_numpy(group_of), lengths).numpy(),
        "truncated": rng.random(samples) < 0.1,
    }


def rollout_as_lists(r: dict[str, np.ndarray]) -> dict[str, list]:
    def split(offsets: np.ndarray, values: np.ndarray) -> list[list]:
        flat = values.tolist()
        return [flat[start:end] for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]

    prompts = split(r["prompt_offsets"], r["prompt_values"])
    responses = split(r["response_offsets"], r["response_values"])
    samples = len(prompts)
    return {
        "tokens": [p + q for p, q in zip(prompts, responses, strict=True)],
        "response_lengths": r["response_length"].tolist(),
        "rewards": r["advantage"].tolist(),
        "raw_reward": r["raw_reward"].tolist(),
        "truncated": r["truncated"].astype(int).tolist(),
        "sample_indices": list(range(samples)),
        "loss_masks": split(r["response_offsets"], r["loss_mask"]),
        "rollout_log_probs": split(r["response_offsets"], r["logprobs"]),
    }


def rollout_as_table(r: dict[str, np.ndarray]) -> pa.Table:
    samples = len(r["response_length"])

    def lists(offsets: np.ndarray, values: np.ndarray) -> pa.ListArray:
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))

    status_index = np.where(r["truncated"], STATUSES.index("truncated"), STATUSES.index("completed")).astype(np.int8)
    columns = [
        pa.array(np.zeros(samples, dtype=np.int64)),
        pa.array(np.arange(samples, dtype=np.int64)),
        pa.array(r["group_index"]),
        pa.DictionaryArray.from_arrays(pa.nulls(samples, pa.int32()), pa.array([], pa.string())),
        lists(r["prompt_offsets"], r["prompt_values"]),
        lists(r["response_offsets"], r["response_values"]),
        pa.array(r["response_length"]),
        lists(r["response_offsets"], r["logprobs"]),
        lists(r["response_offsets"], r["loss_mask"]),
        pa.array(r["raw_reward"]),
        pa.array(r["advantage"]),
        pa.DictionaryArray.from_arrays(pa.array(status_index), pa.array(STATUSES)),
        pa.array(np.zeros(samples, dtype=np.int64)),
        pc.cast(pa.array(r["group_index"] % 100), pa.string()),
        pa.nulls(samples, pa.string()),
        pa.array(np.ones(samples, dtype=np.int32)),
        pa.DictionaryArray.from_arrays(
            pa.array(np.where(r["truncated"], 1, 0).astype(np.int8)), pa.array(["done", "max_new_tokens"])
        ),
        lists(r["response_offsets"], np.zeros(len(r["response_values"]), dtype=np.int32)),  # every token of version 0
        pa.nulls(samples, pa.list_(pa.float32())),  # each reward at its sample's end
        pa.nulls(samples, pa.float32()),  # no greedy baseline
    ]
    table = pa.Table.from_arrays(columns, schema=ROLLOUT_SCHEMA)
    return with_rollout_metadata(table, rollout_id=0, algorithm="grpo")


def batch_from_lists(data: dict[str, list], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Padded tensors from the dict of lists, sample by sample, as list-based trainers build them."""
    from torch.nn.functional import pad
    from torch.nn.utils.rnn import pad_sequence

    tokens = [torch.tensor(t, dtype=torch.long) for t in data["tokens"]]
    prompt_lens = [len(t) - n for t, n in zip(data["tokens"], data["response_lengths"], strict=True)]
    loss_masks = [
        pad(torch.tensor(m, dtype=torch.int), (p, 0)) for m, p in zip(data["loss_masks"], prompt_lens, strict=True)
    ]
    logprobs = [
        pad(torch.tensor(lp, dtype=torch.float32), (p, 0))
        for lp, p in zip(data["rollout_log_probs"], prompt_lens, strict=True)
    ]
    return {
        "tokens": pad_sequence(tokens, batch_first=True, padding_value=pad_token_id),
        "attention_mask": pad_sequence([torch.ones_like(t) for t in tokens], batch_first=True),
        "response_mask": pad_sequence(loss_masks, batch_first=True).bool(),
        "rollout_logprobs": pad_sequence(logprobs, batch_first=True),
        "advantages": torch.tensor(data["rewards"], dtype=torch.float32),
    }


@ray.remote
class Producer:
    def __init__(self) -> None:
        self.payloads: dict[str, object] = {}

    def build(self, samples: int, seed: int) -> None:
        self.payloads = {}  # release the previous size first
        rollout = make_rollout(samples, seed)
        self.payloads = {"lists": rollout_as_lists(rollout), "table": rollout_as_table(rollout)}

    def hand_over(self, kind: str) -> tuple[list[ray.ObjectRef], float, float]:
        payload = self.payloads[kind]
        started = time.monotonic()
        ref = ray.put(payload)
        return [ref], started, time.monotonic()


@ray.remote
class Consumer:
    def __init__(self) -> None:
        from miles.train.batch import batch_from_table

        self._batch_from_table = batch_from_table
        # A trainer is a long-lived process: first-call costs of either path are paid here, outside the timing.
        tiny = make_rollout(2 * GROUP, seed=1)
        batch_from_lists(rollout_as_lists(tiny), PAD)
        batch_from_table(rollout_as_table(tiny), PAD)

    def pid(self) -> int:
        return os.getpid()

    def receive(self, kind: str, refs: list[ray.ObjectRef], return_batch: bool) -> dict:
        _reset_peak_rss()
        rss_before = _proc_status_kib("VmRSS")["VmRSS"]
        received = time.monotonic()
        payload = ray.get(refs[0])
        got = time.monotonic()
        if kind == "lists":
            batch = batch_from_lists(payload, PAD)
        else:
            b = self._batch_from_table(payload, PAD)
            batch = {
                "tokens": b.tokens,
                "attention_mask": b.attention_mask,
                "response_mask": b.response_mask,
                "rollout_logprobs": b.rollout_logprobs,
                "advantages": b.advantages,
            }
        done = time.monotonic()
        peak = _proc_status_kib("VmHWM")["VmHWM"]
        return {
            "received": received,
            "got": got,
            "done": done,
            "peak_mib": (peak - rss_before) / 1024,
            "shape": tuple(batch["tokens"].shape),
            "batch": batch if return_batch else None,
        }


def _wait_gone(pid: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.02)


def measure(producer, kind: str, return_batch: bool = False) -> dict:
    consumer = Consumer.options(**actor_options()).remote()
    pid = ray.get(consumer.pid.remote())
    refs, started, put_done = ray.get(producer.hand_over.remote(kind))
    result = ray.get(consumer.receive.remote(kind, refs, return_batch))
    located = ray.experimental.get_object_locations(refs)
    result["store_mib"] = located[refs[0]]["object_size"] / MIB
    result.update(
        total=result["done"] - started,
        put=put_done - started,
        handoff=result["received"] - put_done,
        get=result["got"] - result["received"],
        convert=result["done"] - result["got"],
    )
    del refs
    ray.kill(consumer)
    _wait_gone(pid)  # its memory is back before the next measurement starts
    return result


def check_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for name in ("tokens", "attention_mask", "response_mask", "advantages"):
        x, y = a[name], b[name].to(a[name].dtype)
        if not torch.equal(x, y):
            raise AssertionError(f"{name} differs between the two sides")
    if not torch.allclose(a["rollout_logprobs"], b["rollout_logprobs"]):
        raise AssertionError("rollout_logprobs differ between the two sides")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4096,32768,131072", help="comma-separated sample counts")
    parser.add_argument(
        "--repeats", type=int, default=3, help="measured (a)+(b) pairs per size, after one warm-up pair"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parse_args(parser, sizes="64", repeats=1)
    sizes = sorted(int(s) for s in args.sizes.split(","))

    # Room for the largest payload (the pickled lists take ~16 bytes a token) twice over, so that nothing spills.
    store_bytes = 256 * MIB + 2 * 16 * sizes[-1] * (RESPONSE_TOKENS + sum(PROMPT_TOKENS) // 2)
    ray.init(
        address="local",  # a new Ray of its own, never one another process started on this machine
        num_cpus=max(os.cpu_count() or 1, 4),
        object_store_memory=store_bytes,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=True,
        configure_logging=False,
    )
    producer = Producer.options(**actor_options()).remote()

    rows = []
    for index, samples in enumerate(sizes):
        ray.get(producer.build.remote(samples, args.seed))
        check = index == 0
        warm = {kind: measure(producer, kind, return_batch=check) for kind in ("lists", "table")}
        if check:
            check_equal(warm["lists"]["batch"], warm["table"]["batch"])
            print(f"check: both sides give equal tensors at {samples} samples, shape {warm['table']['shape']}")
        runs: dict[str, list[dict]] = {"lists": [], "table": []}
        for _ in range(args.repeats):
            for kind in ("lists", "table"):
                runs[kind].append(measure(producer, kind))
        med = {
            kind: {
                key: statistics.median(r[key] for r in runs[kind])
                for key in ("total", "put", "handoff", "get", "convert", "peak_mib", "store_mib")
            }
            for kind in runs
        }
        rows.append((samples, med))
        for kind, label in (("lists", "(a) lists"), ("table", "(b) table")):
            m = med[kind]
            totals = ", ".join(f"{r['total']:.3f}" for r in runs[kind])
            print(
                f"  {samples:>7} {label}: total {m['total']:.3f} s = put {m['put']:.3f} + handoff {m['handoff']:.3f}"
                f" + get {m['get']:.3f} + convert {m['convert']:.3f}; object store {m['store_mib']:.0f} MiB;"
                f" consumer peak +{m['peak_mib']:.0f} MiB  (totals: {totals})",
                flush=True,
            )
    ray.kill(producer)
    ray.shutdown()

    print()
    print(
        f"{'samples':>8} {'(a) s':>9} {'(b) s':>9} {'speedup':>8} {'(a) peak MiB':>13} {'(b) peak MiB':>13}"
        f" {'(a) store MiB':>14} {'(b) store MiB':>14}"
    )
    for samples, med in rows:
        a, b = med["lists"], med["table"]
        print(
            f"{samples:>8} {a['total']:>9.3f} {b['total']:>9.3f} {a['total'] / b['total']:>8.2f} {a['peak_mib']:>13.0f}"
            f" {b['peak_mib']:>13.0f} {a['store_mib']:>14.0f} {b['store_mib']:>14.0f}"
        )
    a, b = rows[-1][1]["lists"], rows[-1][1]["table"]
    print(f"handover_speedup {a['total'] / b['total']:.2f}")


if __name__ == "__main__":
    main()
