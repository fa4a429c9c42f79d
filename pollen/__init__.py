"""Pollen: FCCL, GLFC and BD-FedProto federated learning on Flower."""

__version__ = "0.1.0"

# The results root every command defaults to (``out-dir`` empty and no ``$POLLEN_OUT_DIR``): ``make run``,
# ``pollen run``, ``pollen fleet``, ``pollen runs`` and a ServerApp started by ``flwr run`` without them.
RUNS_DIR = "runs"
