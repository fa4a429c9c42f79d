"""The app's one error for configuration: a leaf, so every module that validates can raise it without
importing the modules that build the configuration."""


class ConfigError(ValueError):
    """A run-config or node-config value is missing, mistyped or out of range."""
