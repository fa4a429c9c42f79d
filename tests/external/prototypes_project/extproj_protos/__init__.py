"""An external FedProto-style Flower app built on Pollen's PrototypeStrategy."""
