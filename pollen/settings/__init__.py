"""Settings, the ground floor: every run key declared once, the run and node configuration as typed values.

It imports nothing of Pollen, so every layer may import it. A run key is a :func:`setting` field of a
frozen settings class (its default, range and help in one place): the common keys are the sections of
:mod:`pollen.settings.common`, a method family's keys its own class (``pollen/methods/<family>_settings.py``).
:func:`read_run_config` checks a run config against the declarations; the app adds what needs its
registries (``pollen.app.config.parse_run_config``).
"""

from pollen.settings.common import (
    AGGREGATIONS,
    DATA_SPLITS,
    DP_MODES,
    PROFILES,
    RESUMABLE_CHANGES,
    SECTIONS,
    TRACKERS,
    WEIGHTINGS,
)
from pollen.settings.errors import ConfigError
from pollen.settings.keys import (
    Choices,
    Key,
    Range,
    Registered,
    allowed_values,
    check_value,
    declared_keys,
    derived,
    field_keys,
    from_values,
    parse_range,
    setting,
)
from pollen.settings.run_config import (
    COMMON,
    DEFAULTS,
    NodeConfig,
    RunConfig,
    field_name,
    floats,
    parse_node_config,
    read_run_config,
    with_class_names,
)

__all__ = [
    "AGGREGATIONS", "COMMON", "DATA_SPLITS", "DEFAULTS", "DP_MODES", "PROFILES", "RESUMABLE_CHANGES", "SECTIONS",
    "TRACKERS", "WEIGHTINGS", "Choices", "ConfigError", "Key", "NodeConfig", "Range", "Registered", "RunConfig",
    "allowed_values", "check_value", "declared_keys", "derived", "field_keys", "field_name", "floats", "from_values",
    "parse_node_config", "parse_range", "read_run_config", "setting", "with_class_names",
]
