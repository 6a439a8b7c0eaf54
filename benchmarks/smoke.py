"""`--smoke`, which every benchmark takes: its tiniest sizes, which run each of its steps in seconds. A smoke run
checks that the benchmark works end to end; its figures mean nothing."""

from __future__ import annotations

import argparse

# The embedded model without its warm-up: a model that has learned nothing runs the same code.
UNTRAINED_MODEL = ["model.warmup.max_steps=0", "model.warmup.eval_prompts=1"]
# A run of it at the smallest batch: one optimizer step of 4 samples per rollout, no evaluation.
TINY_RUN = [
    *UNTRAINED_MODEL,
    "rollout.rollout_batch_size=2",
    "rollout.n_samples_per_prompt=2",
    "rollout.num_threads=1",
    "train.global_batch_size=4",
    "train.micro_batch_size=4",
    "train.num_threads=1",
    "eval.datasets=[]",
]


def parse_args(parser: argparse.ArgumentParser, **smoke: object) -> argparse.Namespace:
    """The parser's arguments, and --smoke, which makes `smoke` the defaults (an option given still wins)."""
    parser.add_argument(
        "--smoke", action="store_true", help="the tiniest sizes, which run every step in seconds (a check, no figures)"
    )
    args = parser.parse_args()
    if not args.smoke:
        return args
    parser.set_defaults(**smoke)
    return parser.parse_args()
