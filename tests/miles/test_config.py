"""miles.config: defaults, YAML + overrides + kwargs layering, and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from miles.cluster.placement import ray_actors
from miles.config import (
    MID_RUN_FIELDS,
    AdapterConfig,
    ConfigError,
    DataConfig,
    MidRunSettings,
    RunConfig,
    config_changes,
    load_config,
)
from miles.config.base import changes_freely


def test_defaults_validate():
    config = load_config()
    assert isinstance(config, RunConfig)
    assert config == RunConfig()
    # The defaults must satisfy the batch-shape rules themselves.
    assert config.samples_per_rollout % config.train.global_batch_size == 0
    assert config.train.global_batch_size % config.train.micro_batch_size == 0
    assert config.samples_per_rollout == config.rollout.rollout_batch_size * config.rollout.n_samples_per_prompt
    assert config.data.task == "addition" and config.data.path is None


@pytest.mark.parametrize("path", sorted(Path("deployments/configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    config = load_config(path)
    assert config.num_rollout > 0


def test_yaml_then_overrides_then_kwargs(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "seed: 3\n"
        "num_rollout: 7\n"
        "rollout:\n"
        "  rollout_batch_size: 8\n"
        "  n_samples_per_prompt: 4\n"
        "  temperature: 0.5\n"
        "train:\n"
        "  global_batch_size: 16\n"
        "  micro_batch_size: 8\n"
        "  lr: 0.01\n"
    )
    config = load_config(
        path,
        ["train.lr=0.002", "algo.use_kl_loss=true", "model.tiny.hidden_size=64", "data.reward=digit_match"],
        num_rollout=9,
        run_dir=str(tmp_path / "run"),
        ray_address=None,  # None kwargs leave the value alone
    )
    # From the file, untouched.
    assert config.seed == 3
    assert config.rollout.rollout_batch_size == 8
    assert config.rollout.n_samples_per_prompt == 4
    assert config.rollout.temperature == 0.5
    assert config.train.global_batch_size == 16
    assert config.train.micro_batch_size == 8
    # Overrides win over the file, and reach nested sections the file does not mention.
    assert config.train.lr == pytest.approx(0.002)
    assert config.algo.use_kl_loss is True
    assert config.model.tiny.hidden_size == 64
    assert config.model.tiny.num_layers == 2  # sibling keeps its default
    assert config.data.reward == "digit_match"
    # Top-level kwargs win over the file.
    assert config.num_rollout == 9
    assert config.run_dir == str(tmp_path / "run")
    assert config.ray_address is None


def test_override_without_file_and_null_value():
    config = load_config(None, ["data.task=null", "data.path=/tmp/x.jsonl", "data.prompt_key=question"])
    assert config.data.task is None
    assert config.data.path == "/tmp/x.jsonl"
    assert config.data.prompt_key == "question"


def test_an_override_of_a_string_field_is_its_text_and_of_any_other_its_yaml_value():
    """A string field takes the text as it is, whatever YAML would read in it (a split named 2024, a system prompt
    'yes'); other fields take the YAML value, typed by the field."""
    config = load_config(None, ["data.split=2024", "data.system_prompt=yes", "train.lr=1e-3", "data.shuffle=no"])
    assert (config.data.split, config.data.system_prompt) == ("2024", "yes")
    assert (config.train.lr, config.data.shuffle) == (1e-3, False)


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="a.b=value"):
        load_config(None, ["train.lr"])


def test_an_override_reaches_into_a_list_of_sections_by_index():
    config = load_config(None, [ADAPTERS, "adapters.1.lr=0.5", "adapters.1.data.task=addition"])
    assert (config.adapters[1].lr, config.adapters[1].data.task, config.adapters[0].lr) == (0.5, "addition", 0.01)
    assert "adapters holds 2 items; 2 is not one of them" in _message(ADAPTERS, "adapters.2.lr=0.5")
    assert "adapters holds 2 items; add is not one of them" in _message(ADAPTERS, "adapters.add.lr=0.5")


def _message(*overrides: str, path=None, **fields) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), **fields)
    return str(info.value)


def test_unknown_field_is_named():
    message = _message("train.lrr=0.1")
    assert "train.lrr" in message


def test_negative_size_is_named():
    message = _message("rollout.rollout_batch_size=-1")
    assert "rollout.rollout_batch_size" in message


def test_unknown_advantage_estimator_is_named():
    message = _message("algo.advantage_estimator=ppo2")
    assert "algo.advantage_estimator" in message
    assert "grpo" in message  # the estimators there are


def test_config_error_is_value_error():
    with pytest.raises(ValueError):
        load_config(None, ["train.lr=-1"])


def test_global_batch_must_divide_samples():
    # 8 prompts x 3 samples = 24 samples, not a multiple of 16.
    message = _message(
        "rollout.rollout_batch_size=8",
        "rollout.n_samples_per_prompt=3",
        "train.global_batch_size=16",
        "train.micro_batch_size=8",
    )
    assert "train.global_batch_size" in message
    assert "24" in message


def test_global_batch_dividing_samples_is_accepted():
    config = load_config(
        None,
        [
            "rollout.rollout_batch_size=8",
            "rollout.n_samples_per_prompt=3",
            "train.global_batch_size=12",
            "train.micro_batch_size=4",
        ],
    )
    assert config.samples_per_rollout == 24


def test_a_micro_batch_size_need_not_divide_the_global_batch():
    """The loss is normalised by the global batch's counts, so micro-batches of 6, 6 and 4 make the step that one of
    16 does (tests/miles/train/test_actor.py), and a micro_batch_size larger than the batch is a cap, not an error."""
    for micro in (6, 256):
        config = load_config(
            None,
            [
                "rollout.rollout_batch_size=8",
                "rollout.n_samples_per_prompt=4",
                "train.global_batch_size=16",
                f"train.micro_batch_size={micro}",
            ],
        )
        assert config.train.micro_batch_size == micro


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["train.num_workers=2", "train.sharding=none"],
            "train.sharding=none runs one worker; num_workers=2 needs fsdp",
        ),
        (
            ["train.param_dtype=bfloat16", "train.sharding=none"],
            "train.param_dtype=bfloat16 is FSDP2's mixed precision",
        ),
        (["train.num_workers=3"], "train.num_workers (3) must divide train.global_batch_size (256)"),
    ],
)
def test_trainer_parallelism_that_cannot_run_is_named(overrides, expected):
    assert expected in _message(*overrides)


@pytest.mark.parametrize(
    "overrides, sharded",
    [
        ([], False),
        (["train.num_workers=2"], True),
        (["train.param_dtype=bfloat16"], True),
        (["train.sharding=fsdp"], True),
    ],
)
def test_sharding_follows_the_workers_and_the_dtype_unless_set(overrides, sharded):
    assert load_config(None, overrides).train.sharded is sharded


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            ["rollout.weight_transport=distributed", "rollout.device=cuda", "train.device=cpu"],
            "train.device (cpu) and rollout.device (cuda) must both be cpu or both cuda",
        ),
    ],
)
def test_a_weight_transport_that_cannot_run_is_named(overrides, expected):
    assert expected in _message(*overrides)


def test_data_with_both_task_and_path():
    message = _message("data.path=prompts.jsonl")  # task keeps its default "addition"
    assert "data.task" in message and "data.path" in message


def test_data_with_neither_task_nor_path():
    message = _message("data.task=null")
    assert "data.task" in message and "data.path" in message


def test_missing_config_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = _message(path=missing)
    assert str(missing) in message


def test_unreadable_config_file(tmp_path):
    # A directory cannot be read as a file (chmod is no use when the tests run as root).
    message = _message(path=tmp_path)
    assert str(tmp_path) in message


def test_invalid_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("train: [unclosed\n")
    message = _message(path=path)
    assert str(path) in message


@pytest.mark.parametrize("text", ["- a\n- b\n", "just a string\n", "42\n"])
def test_non_mapping_yaml(tmp_path, text):
    path = tmp_path / "list.yaml"
    path.write_text(text)
    message = _message(path=path)
    assert str(path) in message
    assert "mapping" in message


def test_empty_yaml_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == RunConfig()


def test_file_errors_name_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lrr: 0.1\n")
    message = _message(path=path)
    assert str(path) in message
    assert "train.lrr" in message


ADAPTERS = "adapters=[{name: add, lr: 0.01, num_steps: 7, rollout_batch_size: 4, n_samples_per_prompt: 2}, {name: sub-2, data: {task: subtraction}, global_batch_size: 64}]"


def test_adapter_view_is_the_run_as_the_adapter_sees_it(tmp_path):
    config = load_config(None, [ADAPTERS, "train.micro_batch_size=32", "seed=3"], run_dir=str(tmp_path / "run"))
    add, sub = (config.adapter_view(a) for a in config.adapters)
    assert add.run_dir == str(tmp_path / "run" / "adapters" / "add") and add.num_rollout == 7
    assert (add.rollout.rollout_batch_size, add.rollout.n_samples_per_prompt) == (4, 2)
    # The whole rollout per optimizer step unless the adapter says otherwise; micro-batches never exceed it.
    assert (add.train.lr, add.train.global_batch_size, add.train.micro_batch_size) == (0.01, 8, 8)
    assert (sub.train.global_batch_size, sub.train.micro_batch_size, sub.data.task) == (64, 32, "subtraction")
    assert add.adapters == [] and add.seed != sub.seed != config.seed  # each adapter samples and shuffles its own way
    assert config.adapter_view(config.adapters[0]) == add


@pytest.mark.parametrize(
    ("adapters", "message"),
    [
        ("[{name: Add}]", "adapters.0.name"),
        ("[{name: a}, {name: a}]", "names must be unique"),
        (
            "[{name: a, global_batch_size: 7}]",
            "global_batch_size (7) must divide rollout_batch_size x n_samples_per_prompt (256)",
        ),
        ("[{name: a, rank: 0}]", "adapters.0.rank"),
        ("[{name: a, target_modules: []}]", "adapters.0.target_modules"),
    ],
)
def test_bad_adapters_are_named(adapters, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"adapters={adapters}"])
    assert message in str(info.value)


def test_adapter_view_names_the_adapter_when_shared_settings_do_not_fit():
    config = load_config(
        None,
        [
            "adapters=[{name: a, global_batch_size: 64}]",
            "train.num_workers=3",
            "train.global_batch_size=48",
            "rollout.rollout_batch_size=6",
        ],
    )
    with pytest.raises(ConfigError, match="adapter 'a'") as info:
        config.adapter_view(config.adapters[0])
    assert "train.num_workers (3) must divide train.global_batch_size (64)" in str(info.value)


def test_eval_defaults_to_a_greedy_sample_of_a_built_in_task_and_to_none_for_a_data_file(tmp_path):
    (dataset,) = load_config().eval_datasets
    assert (dataset.name, dataset.task, dataset.temperature, dataset.n_samples_per_prompt) == (
        "addition",
        "addition",
        0,
        1,
    )
    assert dataset.max_prompts == 200
    data = ["data.task=null", f"data.path={tmp_path / 'train.jsonl'}"]
    assert load_config(None, data).eval_datasets == []
    assert load_config(None, ["eval.datasets=[]"]).eval_datasets == []
    custom = load_config(None, [f"eval.datasets=[{{name: test, path: {tmp_path / 'test.jsonl'}, reward: gsm8k}}]"])
    assert [(d.name, d.task, d.reward) for d in custom.eval_datasets] == [("test", None, "gsm8k")]


def test_eval_schedule_is_before_training_every_interval_and_at_the_end():
    config = load_config(None, ["eval.interval=2"], num_rollout=5)
    assert [i for i in range(7) if config.should_evaluate(i)] == [0, 2, 4, 5]
    config = load_config(None, ["eval.before_training=false"], num_rollout=5)
    assert [i for i in range(7) if config.should_evaluate(i)] == [5]
    assert not any(load_config(None, ["eval.datasets=[]"], num_rollout=5).should_evaluate(i) for i in range(7))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["eval.datasets=[{name: a, task: addition, n_samples_per_prompt: 4}]"], "temperature 0 decodes greedily"),
        (["eval.datasets=[{name: a, task: addition}, {name: a, task: subtraction}]"], "repeated: \\['a'\\]"),
        (["eval.datasets=[{name: Sums, task: addition}]"], "eval.datasets.0.name"),
        (["eval.datasets=[{name: a}]"], "set exactly one of data.task and data.path"),
        (["eval.interval=0"], "eval.interval"),
    ],
)
def test_bad_eval_settings_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_an_adapter_evaluates_its_own_task():
    view = load_config().adapter_view(AdapterConfig(name="sub", data=DataConfig(task="subtraction")))
    assert [(d.name, d.task) for d in view.eval_datasets] == [("subtraction", "subtraction")]


def test_the_generation_budget_of_a_sample_counts_every_turn_of_an_episode():
    assert load_config(None, ["rollout.max_new_tokens=6"]).rollout.max_model_tokens == 6
    episodes = ["rollout.env=calculator", "rollout.max_new_tokens=6", "rollout.max_turns=3"]
    assert load_config(None, episodes).rollout.max_model_tokens == 18
    assert load_config(None, [*episodes, "rollout.max_episode_tokens=10"]).rollout.max_model_tokens == 10


def test_the_launch_settings_are_the_fields_that_choose_programs():
    config = load_config(None, ["rollout.sglang.python=/opt/sglang/bin/python"])
    assert config.launch_settings() == {
        "rollout.sglang.python": "/opt/sglang/bin/python",
        "rollout.sglang.server_module": "sglang.launch_server",
        "rollout.sglang.extra_args": [],
    }


def test_a_built_in_task_takes_the_embedded_preset_and_own_data_the_fields_defaults():
    embedded = load_config(None)
    assert (embedded.train.lr, embedded.train.adam_betas, embedded.rollout.max_new_tokens) == (5e-4, (0.9, 0.98), 4)
    assert embedded.train.max_tokens_per_micro_batch is None
    own = load_config(None, ["data.task=null", "data.path=prompts.jsonl"])
    assert (own.train.lr, own.train.adam_betas, own.rollout.max_new_tokens) == (1e-6, (0.9, 0.999), 1024)
    assert own.train.max_tokens_per_micro_batch == 8192 and own.train.gradient_checkpointing
    assert not embedded.train.gradient_checkpointing


def test_a_value_set_wins_over_the_preset_and_survives_a_round_trip():
    config = load_config(
        None, ["data.task=null", "data.path=prompts.jsonl", "train.lr=3e-6", "rollout.max_new_tokens=512"]
    )
    assert (config.train.lr, config.rollout.max_new_tokens, config.train.adam_betas) == (3e-6, 512, (0.9, 0.999))
    assert RunConfig.model_validate(config.model_dump()) == config


def test_the_critic_is_a_trainer_group_of_its_own_with_the_policy_trainers_settings(tmp_path):
    config = load_config(
        None, ["algo.advantage_estimator=gae", "critic.num_workers=2", "train.num_workers=1"], run_dir=str(tmp_path)
    )
    assert ray_actors(config, critic=True) == config.rollout.num_engines + 1 + 2
    view = config.critic_view()
    assert (view.train.num_workers, view.train.lr, view.train.sharded) == (2, config.critic.lr, True)
    assert view.run_dir == str(tmp_path / "critic") and view.train.global_batch_size == config.train.global_batch_size
    assert ray_actors(config, critic=False) == config.rollout.num_engines + 1
    assert (load_config(None).critic.lr, load_config(None, ["data.task=null", "data.path=p.jsonl"]).critic.lr) == (
        2e-3,
        1e-5,
    )


def test_a_start_may_change_the_fields_marked_to_change_freely_and_no_other():
    recorded = load_config(None, [ADAPTERS]).model_dump(mode="json")
    free = [
        "num_rollout=9",
        "train.num_workers=2",
        "rollout.sglang.python=/opt/sglang/bin/python",  # a section marked: every field in it
        "eval.interval=5",
        "adapters.0.num_steps=3",
        "adapters.1.data.reward_timeout_s=5",  # a data section's field, inside an adapter
    ]
    assert config_changes(recorded, load_config(None, [ADAPTERS, *free]).model_dump(mode="json")) == []
    meaning = ["train.lr=0.1", "rollout.temperature=0.5", "adapters.0.lr=0.5", "data.task=subtraction"]
    assert config_changes(recorded, load_config(None, [ADAPTERS, *free, *meaning]).model_dump(mode="json")) == [
        "adapters.add.lr: 0.01 -> 0.5",
        'data.task: "addition" -> "subtraction"',
        "rollout.temperature: 1.0 -> 0.5",
        "train.lr: 0.0005 -> 0.1",
    ]
    assert not changes_freely(RunConfig, "train.no_such_field")  # a field it does not know is compared


def test_the_pause_form_is_made_from_the_fields_marked_mid_run_with_their_bounds():
    assert MID_RUN_FIELDS == {
        "num_rollout": "num_rollout",
        "save_interval": "save_interval",
        "temperature": "rollout.temperature",
        "kl_loss_coef": "algo.kl_loss_coef",
        "entropy_coef": "algo.entropy_coef",
        "lr": "train.lr",
        "eval_interval": "eval.interval",
    }
    config = load_config(None, ["changes=[{rollout_id: 3, values: {train.lr: 0.01}}]"])
    assert MidRunSettings.of(config, 2).lr == 5e-4 and MidRunSettings.of(config, 3).lr == 0.01
    form = MidRunSettings.of(config, 3)
    assert MidRunSettings.model_fields["temperature"].description.startswith(
        "rollout.temperature: the sampling temperature"
    )
    with pytest.raises(ValueError, match="temperature"):  # the config field's bound (> 0) holds in the form
        form.temperature = 0.0
    form.temperature, form.changed_by, form.reason = 0.5, "ana", "less noise"
    change = form.change(config, 3)
    assert (change.rollout_id, change.values, change.by, change.reason) == (
        3,
        {"rollout.temperature": 0.5},
        "ana",
        "less noise",
    )
    assert MidRunSettings.of(config, 3).change(config, 3) is None


def test_a_scheduled_change_of_a_field_not_marked_mid_run_is_refused():
    with pytest.raises(ConfigError, match="data.task cannot change in the middle of a run"):
        load_config(None, ["changes=[{rollout_id: 1, values: {data.task: subtraction}}]"])
