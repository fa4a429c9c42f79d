"""Pollen: FCCL, GLFC and BD-FedProto federated learning on Flower."""

__version__ = "0.1.0"
