"""Typed run configuration: dataclasses, TOML loading, command-line overrides, validation.

Every field has a docstring (the string literal under it); `rlvr train --help` prints them.
Defaults live here and nowhere else. Loading is strict: an unknown section or key, a value of the
wrong type, or a value out of range is a `ConfigError` that names the key, and the file and line
when the value came from a file, before any model is built or any file is written.

The package is three modules, imported here under one name (`from rlvr import config`):
`schema` (the section dataclasses and limits), `loading` (TOML, overrides, `--help`, writing back)
and `validation` (range and consistency checks). Standard library only.
"""

from rlvr.config.loading import ALIASES, field_docs, help_text, load, read_text, to_dict, to_toml
from rlvr.config.schema import (ENV_NAME, GROUP_SCHEMES, MAX_BUILTIN_CONTEXT, MAX_REWARD_CPU_S, MAX_REWARD_FILE_MB,
                                MAX_REWARD_MEMORY_MB, MAX_REWARD_PROCESSES, MAX_REWARD_TIMEOUT_S, MAX_SEED,
                                MIN_TEMPERATURE, SECTIONS, AlgorithmConfig, Config, ConfigError, DistributedConfig,
                                EvalConfig, LogConfig, ModelConfig, SamplingConfig, SftConfig, TaskConfig, TrainConfig)
from rlvr.config.validation import check_against_task, validate, where

__all__ = [
    "ALIASES", "ENV_NAME", "GROUP_SCHEMES", "MAX_BUILTIN_CONTEXT", "MAX_REWARD_CPU_S", "MAX_REWARD_FILE_MB",
    "MAX_REWARD_MEMORY_MB", "MAX_REWARD_PROCESSES", "MAX_REWARD_TIMEOUT_S", "MAX_SEED", "MIN_TEMPERATURE",
    "SECTIONS", "AlgorithmConfig", "Config", "ConfigError", "DistributedConfig", "EvalConfig", "LogConfig",
    "ModelConfig", "SamplingConfig", "SftConfig", "TaskConfig", "TrainConfig", "check_against_task",
    "field_docs", "help_text", "load", "read_text", "to_dict", "to_toml", "validate", "where",
]
