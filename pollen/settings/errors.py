"""The one error for configuration: a leaf, so every module that validates can raise it."""


class ConfigError(ValueError):
    """A run-config or node-config value is missing, mistyped or out of range."""
