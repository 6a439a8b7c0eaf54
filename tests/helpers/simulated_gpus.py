"""Runs on a simulated GPU node: a Ray cluster (ray.cluster_utils.Cluster) whose node declares 8 GPUs that do not
exist, so that Ray's GPU accounting, placement groups and CUDA_VISIBLE_DEVICES are real while torch runs on the CPU
(MILES_SIMULATED_GPUS, miles.cluster.placement). Run as a script (its own Ray, apart from the test session's):

    python -m tests.helpers.simulated_gpus MODEL_DIR WORK_DIR

Three runs of the plain loops on rollout.device=cuda and train.device=cuda, one after another on one cluster: the sync
loop with 4 engines apart from 2 trainer ranks, the sync loop with 2 SGLang stand-ins colocated with 2 trainer ranks
(each taking its rank's tensor payloads, and releasing its memory for every train step), and the multi-LoRA loop with
two trainer groups. Prints, as JSON on its last line, each run's placement (run.json's, or read from its actors), what
it trained, and for the colocated run what each release left the engines able to do."""

from __future__ import annotations

import json
import sys
from pathlib import Path

GPUS_PER_NODE = 8


def main(model_dir: str, work_dir: str) -> None:
    import ray

    from miles.cluster.placement import location_of, simulated_cluster
    from miles.engines.base import GenerateRequest
    from miles.loop import run_multi_lora, run_sync
    from miles.multi_lora.run import MultiLoRARun
    from miles.rollout.inference_controller import InferenceController
    from miles.state.run_dir import RunDir
    from tests.helpers import sglang_overrides, small_config_for

    work = Path(work_dir)
    on_gpus = ["rollout.device=cuda", "train.device=cuda"]
    report: dict = {}
    with simulated_cluster(nodes=1, gpus_per_node=GPUS_PER_NODE) as address:
        try:

            def sync(name: str, *overrides: str) -> None:
                config = small_config_for(
                    Path(model_dir), work / name, *on_gpus, *overrides, num_rollout=2, ray_address=address
                )
                run_sync(config)
                run_dir = RunDir(config.run_dir)
                report[name] = {
                    "placement": json.loads(run_dir.record_path.read_text())["starts"][-1]["placement"],
                    "trained": sorted(run_dir.ledger().trained),
                }

            sync("apart", "rollout.num_engines=4", "train.num_workers=2")
            releases: list = []
            original_release = InferenceController.release_memory

            def release_and_try(controller: InferenceController, weights: bool) -> None:
                """Each release, and what an engine answers a generation right after it (it must refuse)."""
                original_release(controller, weights)
                try:
                    ray.get(controller.engines[0].generate.remote([GenerateRequest(prompt_ids=[1, 2])]))
                    answer = "generated"
                except ray.exceptions.RayTaskError as exc:
                    answer = str(exc.cause)
                releases.append({"weights": weights, "generate": answer})

            InferenceController.release_memory = release_and_try
            sync(
                "colocated_sglang", *sglang_overrides(), "rollout.colocate=true", "rollout.num_engines=2",
                "train.num_workers=2", "rollout.sglang.attention_backend=triton",  # serves the float32 model
            )  # fmt: skip
            InferenceController.release_memory = original_release
            report["colocated_sglang"]["releases"] = releases

            adapters = (
                "adapters=[{name: add, data: {task: addition, reward: digit_match}, num_steps: 2, rollout_batch_size: 4,"
                " n_samples_per_prompt: 4, trainer_group: first},"
                " {name: sub, data: {task: subtraction, reward: digit_match}, num_steps: 2, rollout_batch_size: 4,"
                " n_samples_per_prompt: 4, trainer_group: second}]"
            )
            config = small_config_for(
                Path(model_dir), work / "multi_lora", *on_gpus, adapters, "rollout.num_engines=2", ray_address=address
            )
            seen: dict = {}
            original_start = MultiLoRARun._start

            def start_and_note(run: MultiLoRARun, checked) -> None:
                original_start(run, checked)
                seen["engines"] = [location.record() for location in run.controller.locations()]
                seen["trainer_groups"] = {
                    name: [location_of(handle).record() for handle in group.handles]
                    for name, group in run.trainer_groups.items()
                }

            MultiLoRARun._start = start_and_note
            records = run_multi_lora(config)
            report["multi_lora"] = {**seen, "trained": {name: len(rows) for name, rows in records.items()}}
            print(json.dumps(report))
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
