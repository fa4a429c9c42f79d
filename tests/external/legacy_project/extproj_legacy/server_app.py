"""Legacy ServerApp: ``server_fn`` returning ``ServerAppComponents`` with Pollen's legacy strategy.

A small subclass records what each round aggregated to the report file (the legacy loop returns
nothing a ServerApp can read back).
"""

from __future__ import annotations

import json
from pathlib import Path

from flwr.common import Context, parameters_to_ndarrays
from flwr.server import ServerApp, ServerAppComponents, ServerConfig

from pollen.strategies.legacy import LegacyPrototypeStrategy


class RecordingPrototypes(LegacyPrototypeStrategy):
    def __init__(self, report_path: str, **kwargs):
        super().__init__(**kwargs)
        self.report_path = Path(report_path)
        self.report: dict = {"fit": {}, "evaluate": {}}

    def _write(self) -> None:
        self.report_path.parent.mkdir(parents=True, exist_ok=True)
        self.report_path.write_text(json.dumps(self.report, indent=1, default=str))

    def aggregate_fit(self, server_round, results, failures):
        parameters, metrics = super().aggregate_fit(server_round, results, failures)
        arrays = parameters_to_ndarrays(parameters) if parameters is not None else []
        self.report["fit"][server_round] = {
            "results": len(results), "failures": len(failures), "metrics": dict(metrics),
            "arrays": [{"dtype": str(a.dtype), "shape": list(a.shape), "values": a.tolist()} for a in arrays]}
        self._write()
        return parameters, metrics

    def aggregate_evaluate(self, server_round, results, failures):
        loss, metrics = super().aggregate_evaluate(server_round, results, failures)
        self.report["evaluate"][server_round] = {"results": len(results), "failures": len(failures),
                                                 "loss": loss, "metrics": dict(metrics)}
        self._write()
        return loss, metrics


def server_fn(context: Context) -> ServerAppComponents:
    cfg = context.run_config
    rounds = int(cfg["num-server-rounds"])
    strategy = RecordingPrototypes(str(cfg["report-path"]), num_classes=int(cfg["num-classes"]),
                                   embed_dim=int(cfg["embed-dim"]), min_available_clients=int(cfg["min-nodes"]),
                                   num_rounds=rounds)
    return ServerAppComponents(strategy=strategy, config=ServerConfig(num_rounds=rounds))


app = ServerApp(server_fn=server_fn)
