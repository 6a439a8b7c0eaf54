"""The generative judge vs exact_match on the embedded task: one round of samples from the warmed-up model, scored
by both. The judge is the warm-up model itself on engines of its own, asked each question (judge.prompt_template
"{prompt}") and scoring a response 1 when its own greedy answer is the response's (judge.verdict=same_answer).

Prints how many samples the two rewards score alike, and the judge's and exact_match's throughput (samples per
second of scoring, the judge's engines started before the clock).

Last line: `judge_agreement <fraction of samples scored alike>`.
"""

from __future__ import annotations

import argparse
import tempfile
import time

from transformers import AutoTokenizer

from benchmarks.smoke import UNTRAINED_MODEL, parse_args
from miles.cluster.actors import ensure_ray
from miles.config import load_config
from miles.data.datasets import load_rows
from miles.engines.base import GenerateRequest, SamplingParams, eos_token_ids
from miles.engines.torch_engine import TorchEngine
from miles.models.tiny import ensure_embedded_model
from miles.rewards import exact_match
from miles.rewards.models import GenerativeJudge

JUDGE = ["judge.prompt_template={prompt}", "judge.verdict=same_answer", "judge.max_new_tokens=4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="config override a.b=value")
    args = parse_args(parser, samples=16, overrides=UNTRAINED_MODEL)
    config = load_config(None, args.overrides, run_dir=tempfile.mkdtemp(prefix="judge-"))
    model_dir = ensure_embedded_model(config.model, [config.data.task], config.seed)
    config = load_config(None, [*args.overrides, *JUDGE, f"judge.model_path={model_dir}"], run_dir=config.run_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = load_rows(config.data)[: args.samples]
    rows = (rows * (args.samples // len(rows) + 1))[: args.samples]
    prompts, labels = [r["prompt"] for r in rows], [r["label"] for r in rows]
    sampling = SamplingParams(max_new_tokens=config.rollout.max_new_tokens, stop_token_ids=eos_token_ids(tokenizer))
    requests = [
        GenerateRequest(prompt_ids=ids, sampling=sampling, seed=i)
        for i, ids in enumerate(tokenizer(prompts)["input_ids"])
    ]
    results = TorchEngine(str(model_dir), num_threads=config.rollout.num_threads).generate(requests)
    responses = tokenizer.batch_decode([r.output_ids for r in results], skip_special_tokens=True)
    finished = [r.finish_reason == "stop" for r in results]

    started = time.perf_counter()
    exact = [exact_match(r, la, f) for r, la, f in zip(responses, labels, finished, strict=True)]
    exact_s = time.perf_counter() - started
    ensure_ray(None, actors=config.judge.num_engines)
    judge = GenerativeJudge(config.judge, config.rollout)
    try:
        judge.score_batch(prompts[:1], responses[:1], labels[:1], [True])  # the engines start outside the clock
        started = time.perf_counter()
        judged = judge.score_batch(prompts, responses, labels, finished)
        judge_s = time.perf_counter() - started
    finally:
        judge.close()
    alike = sum(j == e for j, e in zip(judged, exact, strict=True))
    both_right = sum(j == e == 1.0 for j, e in zip(judged, exact, strict=True))
    print(f"samples {len(rows)}  exact_match passes {sum(exact):.0f}  judge passes {sum(j or 0 for j in judged):.0f}")
    print(
        f"scored alike {alike}  both pass {both_right}  judge passes, exact_match fails {sum(j == 1.0 and e == 0.0 for j, e in zip(judged, exact, strict=True))}"
    )
    print(
        f"throughput: judge {len(rows) / judge_s:.0f} samples/s  exact_match {len(rows) / max(exact_s, 1e-9):.0f} samples/s"
    )
    print(f"judge_agreement {alike / len(rows):.3f}")


if __name__ == "__main__":
    main()
