"""Server-side strategies (Flower ``Strategy`` subclasses) other Flower projects can import."""

from pollen.strategies.weights import LocalOnly, WeightAveraging, average_arrays  # noqa: F401
