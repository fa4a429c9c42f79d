"""An external FedMD-style Flower app built on Pollen's LogitAveraging."""
