"""Config schema (dataclasses), strict loader, batch planning and the shipped YAML files."""

from configs.loader import CONFIG_DIR, ConfigError, load_config, to_dict, to_yaml
from configs.schema import Config

__all__ = ["CONFIG_DIR", "Config", "ConfigError", "load_config", "to_dict", "to_yaml"]
