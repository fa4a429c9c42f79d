"""Message-API strategies (``flwr.serverapp.strategy.Strategy`` subclasses) any Flower project can use.

numpy only: importing this package does not import torch. GLFC's strategy (which runs a torch proxy)
lives in :mod:`pollen.strategies.glfc`; the deprecated-API adapters in :mod:`pollen.strategies.legacy`.
"""

from pollen.strategies.base import PollenStrategy  # noqa: F401
from pollen.strategies.logits import LogitAveraging, mean_logits  # noqa: F401
from pollen.strategies.prototypes import PrototypeStrategy, aggregate_prototypes, prototype_margin  # noqa: F401
from pollen.strategies.replies import NoTrainingError  # noqa: F401
from pollen.strategies.weights import LocalOnly, WeightAveraging, average_arrays  # noqa: F401
