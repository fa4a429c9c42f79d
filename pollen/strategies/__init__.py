"""Server-side strategies (Flower ``Strategy`` subclasses) other Flower projects can import."""

from pollen.strategies.weights import LocalOnly, WeightAveraging, average_arrays  # noqa: F401
from pollen.strategies.prototypes import PrototypeStrategy, aggregate_prototypes, prototype_margin  # noqa: F401
from pollen.strategies.logits import LogitAveraging, mean_logits  # noqa: F401
from pollen.strategies.glfc import IncrementalFedAvg  # noqa: F401
