"""Plans (miles.cluster.placement.plan_placement) of several configs on simulated GPU clusters, one cluster per shape. Run as a
script (its own Ray, apart from the test session's), with a JSON list of cases on standard input, each
{"shape": [nodes, gpus_per_node], "config": path or null, "overrides": [...]}; prints, as JSON on its last line, each
case's placement record, or its refusal."""

from __future__ import annotations

import json
import sys
from itertools import groupby


def main() -> None:
    import ray

    from miles.cluster.actors import ensure_ray
    from miles.cluster.placement import plan_placement, simulated_cluster
    from miles.config import load_config
    from miles.train.algorithms import resolve_estimator

    cases = json.load(sys.stdin)
    results: list = [None] * len(cases)
    indexed = sorted(enumerate(cases), key=lambda item: item[1]["shape"])
    for shape, group in groupby(indexed, key=lambda item: item[1]["shape"]):
        with simulated_cluster(*shape) as address:
            ensure_ray(address, actors=1)
            try:
                for index, case in group:
                    config = load_config(case["config"], case["overrides"])
                    try:
                        critic = resolve_estimator(config.algo).needs_critic
                        results[index] = {"record": plan_placement(config, critic).record()}
                    except (ValueError, RuntimeError) as exc:
                        results[index] = {"refused": str(exc)}
            finally:
                ray.shutdown()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
