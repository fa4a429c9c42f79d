"""Which model a client trains, and the description every model is built from; without torch.

:func:`choose_model` is the one "which model" rule (node config, run key ``model``, the task's default;
the width from ``model-width`` or the profile) and gives a :class:`ModelSpec`: clients, the server,
the run-config check and ``pollen predict`` all build from one. Importing this module imports no torch:
:meth:`ModelSpec.build` imports the networks when it builds one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from pollen.models.catalog import SMALL_MODELS, feature_dim
from pollen.settings import NodeConfig, RunConfig

if TYPE_CHECKING:
    from pollen.models.base import SplitModel


# The width of the large backbones when ``model-width = 0`` ("let the profile decide"). The small nets
# (SMALL_MODELS) are already CPU-sized and keep their paper width unless ``model-width`` says otherwise.
PROFILE_WIDTH = {"quick": 0.25, "paper": 1.0}


@dataclass(frozen=True)
class ModelSpec:
    """Everything that rebuilds a model: the one description clients, the server and ``pollen predict``
    build from, saved beside every trained model (:meth:`to_json`) so loading it needs nothing else."""

    name: str
    num_classes: int
    in_channels: int = 3
    image_size: int = 32
    width: float = 1.0
    options: Mapping[str, Any] = field(default_factory=dict)  # per-model keyword arguments (MODEL_KWARGS)

    def build(self) -> SplitModel:
        from pollen.models.registry import build_model  # torch: only where a model is built

        return build_model(self.name, self.num_classes, in_channels=self.in_channels, image_size=self.image_size,
                           width=self.width, **dict(self.options))

    @property
    def feature_dim(self) -> int | None:
        """d of this model, from the catalog (None for a model it does not describe: build it to know)."""
        return feature_dim(self.name, self.in_channels, self.image_size, self.width, self.options)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.name, "num-classes": self.num_classes, "in-channels": self.in_channels,
                "image-size": self.image_size, "width": self.width, "model-kwargs": dict(self.options)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ModelSpec:
        """The spec a model's JSON describes; a missing or mistyped field is a ValueError naming it."""
        try:
            return cls(str(data["model"]), int(data["num-classes"]), int(data["in-channels"]),
                       int(data["image-size"]), float(data["width"]), dict(data.get("model-kwargs") or {}))
        except KeyError as err:
            raise ValueError(f"the model description lacks {err.args[0]!r}") from None
        except (TypeError, ValueError) as err:
            raise ValueError(f"the model description has a bad value: {err}") from None


class _Format(Protocol):
    @property
    def channels(self) -> int: ...

    @property
    def size(self) -> int: ...


class TaskFacts(Protocol):
    """What the model rule reads of a task (a :class:`pollen.datasets.spec.TaskSpec`)."""

    @property
    def num_classes(self) -> int: ...

    @property
    def fmt(self) -> _Format: ...

    def model_for(self, partition_id: int) -> str: ...


def choose_model(cfg: RunConfig, task: TaskFacts, node: NodeConfig | None = None, *, partition_id: int | None = None,
                 name: str | None = None, options: Mapping[str, Any] | None = None) -> ModelSpec:
    """The one "which model" rule: ``name`` if given, else the node's ``model`` (node config), else the run's
    ``model`` key, else the task's model for the partition (the node's, else partition 0); its width is
    ``model-width``, else the profile's (:data:`PROFILE_WIDTH`; the small nets keep 1.0); the task's classes
    and input format; ``options`` the model's own keyword arguments."""
    if partition_id is None:
        partition_id = node.partition_id if node is not None else 0
    name = name or (node.model if node is not None else None) or cfg.model or task.model_for(partition_id)
    width = cfg.model_width if cfg.model_width > 0 else 1.0 if name in SMALL_MODELS else PROFILE_WIDTH[cfg.profile]
    return ModelSpec(name, task.num_classes, in_channels=task.fmt.channels, image_size=task.fmt.size, width=width,
                     options=dict(options or {}))
