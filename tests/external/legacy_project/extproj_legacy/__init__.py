"""An external Flower app on the legacy API (server_fn, ServerAppComponents, NumPyClient)."""
