"""An external FedAvg Flower app (numpy logistic regression) built on Pollen's WeightAveraging."""
