"""miles.multi_lora.run input checks (the runs themselves: tests/flows/test_multi_lora.py, tests/e2e/test_learning_concurrent.py)."""

import pytest

from miles.cluster.placement import ray_actors
from miles.config import ConfigError, load_config
from miles.multi_lora.inputs import check_adapter_inputs, resolve_adapters


def test_embedded_model_defaults_to_one_adapter_per_built_in_task():
    adapters = resolve_adapters(load_config(None))
    assert [(a.name, a.data.task) for a in adapters] == [("addition", "addition"), ("subtraction", "subtraction")]


def test_own_model_needs_adapters():
    with pytest.raises(ConfigError, match="adapters: the multi-LoRA flow needs at least one adapter"):
        resolve_adapters(load_config(None, ["model.path=/models/base"]))


def test_embedded_model_needs_built_in_tasks(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    config = load_config(None, [f"adapters=[{{name: mine, data: {{task: null, path: {data}}}}}]"])
    with pytest.raises(ConfigError, match=r"adapters\.0\.data\.task: .*'mine'"):
        check_adapter_inputs(config)


def test_each_adapter_gets_its_rows_and_reward(tmp_path, tiny_model_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"q": "1+1=", "a": "2"}\n{"q": "2+2=", "a": "4"}\n')
    config = load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            "adapters=[{name: add, data: {task: addition}}, "
            f"{{name: mine, data: {{task: null, path: {data}, prompt_key: q, label_key: a, reward: digit_match}}}}]",
        ],
        run_dir=str(tmp_path / "run"),
    )
    checked = check_adapter_inputs(config)
    view, rows, reward, eval_sets, _ = checked["mine"]
    assert rows == [{"prompt": "1+1=", "label": "2", "row": 1}, {"prompt": "2+2=", "label": "4", "row": 2}]
    assert reward("24", "24", True) == 1.0 and view.data.reward == "digit_match"
    assert eval_sets == []  # a data set from a path has no default evaluation
    assert len(checked["add"].rows) == 100 * 100
    assert [s.dataset.task for s in checked["add"].eval_sets] == ["addition"]
    with pytest.raises(ConfigError, match=r"adapters\.1 \(mine\): .*bad\.jsonl"):
        bad = load_config(
            None,
            [
                "model.path=/m",
                f"adapters=[{{name: add}}, {{name: mine, data: {{task: null, path: {tmp_path / 'bad.jsonl'}}}}}]",
            ],
        )
        check_adapter_inputs(bad)


def test_an_adapter_whose_batch_does_not_split_over_the_workers_is_refused_by_name():
    config = load_config(
        None,
        [
            "train.num_workers=2",
            "adapters=[{name: add, data: {task: addition}}, "
            "{name: odd, data: {task: addition}, rollout_batch_size: 3, n_samples_per_prompt: 1}]",
        ],
    )
    with pytest.raises(ConfigError, match=r"adapters\.1 \(odd\): .*train\.num_workers \(2\) must divide"):
        check_adapter_inputs(config)


def test_an_estimator_that_needs_a_critic_is_refused_by_the_multi_lora_flow():
    with pytest.raises(ConfigError, match="algo.advantage_estimator=gae trains a critic of the full model; adapters"):
        check_adapter_inputs(load_config(None, ["algo.advantage_estimator=gae", "adapters=[{name: a}]"]))


def test_adapters_name_their_trainer_groups_and_each_group_gets_its_workers():
    config = load_config(
        None,
        [
            "train.num_workers=2",
            "rollout.num_engines=1",
            "adapters=[{name: add, data: {task: addition}}, {name: sub, data: {task: subtraction}, "
            "trainer_group: second}, {name: add-b, data: {task: addition}, trainer_group: second}]",
        ],
    )
    assert [a.trainer_group for a in config.adapters] == ["main", "second", "second"]
    assert ray_actors(config, critic=False) == 1 + 2 * 2
