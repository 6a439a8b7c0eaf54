"""Run configuration: one pydantic model (RunConfig) that is the flow parameter, the YAML file format and the CLI
target, a module per section. What a field names (an import path, a file, a launched program) and when it may change
(mid-run, between starts) are marks on the field itself (miles.config.base)."""

from miles.config.adapters import LORA_TARGET_MODULES, AdapterConfig, TenantsConfig, embedded_adapters
from miles.config.algo import AlgoConfig
from miles.config.base import CHANGES_FREELY, FILE_PATH, IMPORT_PATH, LAUNCH, ConfigError, mid_run
from miles.config.changes import (
    MID_RUN_FIELDS,
    MidRunSettings,
    config_changes,
    field_value,
    recorded_changes,
)
from miles.config.data import DEFAULT_EVAL_PROMPTS, DataConfig, EvalConfig, EvalDatasetConfig
from miles.config.loading import load_adapter_config, load_config, override_config
from miles.config.model import ModelConfig, TinyModelConfig, WarmupConfig
from miles.config.rewards import DEFAULT_JUDGE_TEMPLATE, JudgeConfig, RewardModelConfig
from miles.config.rollout import RolloutConfig, SGLangConfig
from miles.config.run import ConfigChange, RunConfig
from miles.config.tracking import AlertsConfig, LoggingConfig
from miles.config.train import CriticConfig, TrainConfig

__all__ = [
    "CHANGES_FREELY",
    "DEFAULT_EVAL_PROMPTS",
    "DEFAULT_JUDGE_TEMPLATE",
    "FILE_PATH",
    "IMPORT_PATH",
    "LAUNCH",
    "LORA_TARGET_MODULES",
    "MID_RUN_FIELDS",
    "AdapterConfig",
    "AlertsConfig",
    "AlgoConfig",
    "ConfigChange",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "EvalConfig",
    "EvalDatasetConfig",
    "JudgeConfig",
    "LoggingConfig",
    "MidRunSettings",
    "ModelConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RunConfig",
    "SGLangConfig",
    "TenantsConfig",
    "TinyModelConfig",
    "TrainConfig",
    "WarmupConfig",
    "config_changes",
    "embedded_adapters",
    "field_value",
    "load_adapter_config",
    "load_config",
    "mid_run",
    "override_config",
    "recorded_changes",
]
