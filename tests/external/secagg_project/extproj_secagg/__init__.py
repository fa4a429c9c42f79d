"""An external Flower app whose FedAvg runs under Pollen's SecAgg+: the server never sees one update."""
