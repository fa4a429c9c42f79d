"""Who pays torch's import (issue 30, start-up cost): the launcher never does, nor a ServerApp whose strategy
is numpy-only (prototypes, logits, local); the weights family's server does when it builds its starting
model, not before. Each case runs in a fresh interpreter, so an import made by another test cannot hide one.

And the facts those processes read instead of building a model: :mod:`pollen.models.catalog`'s embedding
sizes and first BatchNorm layers against the built networks, and the state keys the registry names
against the clients' own.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from pollen.datasets.spec import TaskOptions
from pollen.models import MODEL_NAMES, build_model
from pollen.models.catalog import FIRST_BATCHNORM, SMALL_MODELS, feature_dim
from pollen.models.catalog import MODEL_NAMES as CATALOG_NAMES
from pollen.privacy.dpsgd import first_cross_sample_layer
from tests.conftest import PROJECT_ROOT

# What "no torch" means: neither torch nor torchvision nor any of their submodules is loaded.
HEAVY = ("torch", "torchvision")



def _steps(body: str) -> dict[str, list[str]]:
    """Run ``body`` in a fresh interpreter; it calls ``report(step)`` after each step. Returns step -> the
    torch/torchvision modules loaded at that point."""
    prelude = textwrap.dedent(f"""
        import json, sys
        def report(step):
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
            print(json.dumps({{"step": step, "heavy": heavy}}), flush=True)
    """)
    done = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(body)], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    out = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            out[row["step"]] = row["heavy"]
    return out


def test_the_launcher_checks_a_fedproto_run_config_without_torch():
    """``pollen run``'s own process: the command, the launcher, and its check of the run config (the
    same call that sizes the population), which parses every key and runs FedProto's own checks."""
    steps = _steps("""
        import pollen.launch.cli
        report("cli")
        from pathlib import Path
        from pollen.launch.compose import fitting_node_count
        report("launcher")
        n = fitting_node_count(Path.cwd(), {"method": "fedproto", "task": "mnist-shot", "proto-lambda": 0.5,
                                            "proto-model-heter": True, "model": "cnn_mnist"}, 7)
        assert n == 7, n
        report("validated")
    """)
    assert steps == {"cli": [], "launcher": [], "validated": []}


def test_the_launcher_checks_a_sample_mode_run_config_without_torch(tmp_path):
    """``dp-mode = 'sample'`` refuses a model with BatchNorm before anything starts (DP-SGD needs
    per-sample gradients): the check reads the catalog, it builds no model, so ``pollen run``'s process
    still never imports torch, whether it accepts the config or refuses it with the layer and the fix."""
    steps = _steps(f"""
        from pathlib import Path
        from pollen.launch.compose import compose_run_config, fitting_node_count
        from pollen.launch.errors import LaunchConfigError
        from pollen.launch.launcher import main
        report("launcher")
        sample = {{"method": "fedavg", "task": "uci-dirichlet", "avg-weighting": "uniform", "dp-mode": "sample",
                  "dp-noise-multiplier": 1.0, "fraction-evaluate": 0.0}}
        values, _ = compose_run_config(Path.cwd(), sample, out_dir={str(tmp_path / "runs")!r})
        assert fitting_node_count(Path.cwd(), values, 3) == 3
        report("accepted")
        for model, layer in (("resnet10", "'bn1' (BatchNorm2d)"), ("googlenet", "'pre_layers.1' (BatchNorm2d)")):
            try:
                fitting_node_count(Path.cwd(), {{**values, "model": model}}, 3)
            except LaunchConfigError as err:
                assert f"model {{model!r}} has layer {{layer}}" in str(err), err
                assert "cnn_mnist, lenet" in str(err) and "or dp-mode = 'payload'" in str(err), err
            else:
                raise AssertionError(model)
        report("refused")
        rc = ("method='fedavg' avg-weighting='uniform' dp-mode='sample' dp-noise-multiplier=1.0 model='resnet18' "
              "fraction-evaluate=0.0")
        assert main(["--out-dir", {str(tmp_path / "runs")!r}, "--run-config", rc]) == 2  # `pollen run`, exit 2
        report("pollen run")
    """)
    assert steps == {"launcher": [], "accepted": [], "refused": [], "pollen run": []}
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(("method", "task", "strategy"), [
    ("fedproto", "mnist-shot", "PrototypeStrategy"),
    ("bd-fedproto", "uci-dirichlet", "PrototypeStrategy"),
    ("fccl", "digits-offline", "LogitAveraging"),
    ("local", "uci-dirichlet", "LocalOnly"),
])
def test_a_numpy_only_serverapp_builds_its_strategy_without_torch(method, task, strategy):
    """What ``server_app.main`` does before round 1: parse the run config, build the strategy, take the
    initial arrays (empty for these families)."""
    steps = _steps(f"""
        import pollen.app.server_app as server
        report("import")
        cfg = server.validated_run_config({{"method": {method!r}, "task": {task!r}}})
        spec = server.METHODS[cfg.method]
        strategy = spec.make_strategy(cfg)
        assert type(strategy).__name__ == {strategy!r}, type(strategy)
        report("strategy")
        assert len(spec.initial_arrays(cfg)) == 0
        report("initial")
    """)
    assert steps == {"import": [], "strategy": [], "initial": []}


def test_the_weights_server_imports_torch_only_to_build_its_initial_model():
    steps = _steps("""
        import pollen.app.server_app as server
        cfg = server.validated_run_config({"method": "fedavg", "task": "uci-dirichlet"})
        spec = server.METHODS[cfg.method]
        spec.make_strategy(cfg)
        report("strategy")
        arrays = spec.initial_arrays(cfg)
        assert len(arrays) > 0
        report("initial")
    """)
    assert steps["strategy"] == []
    assert "torch" in steps["initial"] and "torch.nn" in steps["initial"]


def test_the_probe_sees_torch_when_it_is_imported():
    """The check above can fail: the prototype round (not the registry's declarations) imports torch."""
    steps = _steps("""
        import pollen.methods.prototype_settings
        report("settings")
        import pollen.methods.prototypes
        report("round")
    """)
    assert steps["settings"] == [] and "torch" in steps["round"]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_catalog_gives_each_models_embedding_size(name):
    """The size the prototype server checks replies against, without building: equal to the built
    network's for every width, input format and option (FedProto's heterogeneous CNN channels)."""
    assert CATALOG_NAMES == MODEL_NAMES and SMALL_MODELS <= set(MODEL_NAMES)
    options = [{}, {"channels": 18}, {"channels": 22}] if name == "cnn_mnist" else [{}]
    for width in (1.0, 0.5, 0.25, 0.125, 0.3):
        for channels, size in ((1, 28), (3, 32), (1, 16), (3, 20)):
            for opts in options:
                built = build_model(name, 10, in_channels=channels, image_size=size, width=width, **opts)
                assert feature_dim(name, channels, size, width, opts) == built.feature_dim, (name, width, size)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_the_catalog_names_each_models_first_batchnorm(name):
    """What the run-config check of ``dp-mode = 'sample'`` reads instead of building the model: the
    catalog's first BatchNorm layer (path and class, or none) is the built network's, for every width,
    input format and option (MobileNetV2's count of BatchNorm layers changes with the width; its first
    does not). Built on the meta device: the module tree is all that is compared."""
    assert set(FIRST_BATCHNORM) == set(CATALOG_NAMES)
    options = [{}, {"channels": 18}] if name == "cnn_mnist" else [{}]
    for width in (1.0, 0.5, 0.125, 0.01):
        for channels, size in ((1, 28), (3, 32), (3, 20)):
            for opts in options:
                with torch.device("meta"):
                    built = build_model(name, 10, in_channels=channels, image_size=size, width=width, **opts)
                assert FIRST_BATCHNORM[name] == first_cross_sample_layer(built), (name, width, channels, size)


def test_sample_mode_builds_only_a_model_the_catalog_does_not_describe(monkeypatch):
    """A model added with ``register_model`` has no catalog entry: the run-config check builds it (shapes
    only) to find its first BatchNorm, as it did for every model before, and refuses it the same way."""
    from pollen.app import config
    from pollen.datasets import tasks
    from pollen.models.registry import MODELS, ModelEntry

    def my_net(num_classes, in_channels, image_size, width, **kw):
        return torch.nn.Sequential(torch.nn.Conv2d(in_channels, 4, 3), torch.nn.BatchNorm2d(4))

    monkeypatch.setitem(MODELS, "my-bn-net", ModelEntry(my_net))
    task = tasks.get_task("uci-dirichlet")
    # the registry entry, not the function: a module imported meanwhile would keep a patched function for good
    monkeypatch.setitem(tasks.TASKS, "uci-dirichlet", dataclasses.replace(task, default_model="my-bn-net"))
    cfg = config.parse_run_config({"method": "fedavg", "task": "uci-dirichlet", "avg-weighting": "uniform"})
    cfg = dataclasses.replace(cfg, dp_mode="sample")
    with pytest.raises(config.ConfigError, match=r"model 'my-bn-net' has layer '1' \(BatchNorm2d\).*cnn_mnist, lenet"):
        config._refuse_cross_sample_models(cfg)


def test_a_model_that_disagrees_with_the_catalog_is_refused(monkeypatch):
    """build_model compares every network with the catalog, so a wrong entry fails the first build."""
    from pollen.models import catalog

    monkeypatch.setitem(catalog._FEATURE_DIMS, "resnet10", lambda c, s, w, o: 7)
    with pytest.raises(RuntimeError, match="declares 7"):
        build_model("resnet10", 10, width=0.25)


def test_the_catalog_refuses_what_the_network_refuses_and_knows_only_its_own_models():
    with pytest.raises(ValueError, match="image_size must be >= 16 for cnn_mnist"):
        feature_dim("cnn_mnist", 1, 12)
    with pytest.raises(ValueError, match="image_size must be >= 16 for cnn_mnist"):
        build_model("cnn_mnist", 10, in_channels=1, image_size=12)
    assert feature_dim("my-own-net") is None


def test_the_prototype_server_reads_d_of_the_first_clients_model():
    """FedProto's model-heterogeneous CNN: d is the 50 of every client's fc1, as built."""
    from pollen.app.config import parse_run_config
    from pollen.app.methods_prototypes import embed_dim
    from pollen.datasets.tasks import resolve_task
    from pollen.methods.prototype_settings import heterogeneous_channels
    from pollen.models.spec import choose_model

    for extra in ({"proto-model-heter": True}, {"model": "resnet18", "model-width": 0.125}, {"model": "googlenet"}):
        cfg = parse_run_config({"method": "fedproto", "task": "mnist-shot", **extra})
        task = resolve_task(cfg.task, TaskOptions.of(cfg))
        name = choose_model(cfg, task).name
        opts = {"channels": heterogeneous_channels(0)} if name == "cnn_mnist" else {}
        assert embed_dim(cfg) == choose_model(cfg, task, options=opts).build().feature_dim


def test_the_registry_names_the_clients_own_keys_and_methods():
    """The registry declares these without importing the clients; here they meet."""
    from pollen.app.methods_weights import LOCAL_MODEL_KEY
    from pollen.app.registry import METHODS
    from pollen.clients.weights import LocalClient
    from pollen.methods.logits import LogitRound
    from pollen.methods.prototypes import PROTOTYPE_METHODS, PrototypeRound

    assert METHODS["local"].personal_model == LOCAL_MODEL_KEY == LocalClient.STATE_KEY
    assert {s.personal_model for s in METHODS.values() if s.family == "logits"} == {LogitRound.NET}
    assert {s.personal_model for s in METHODS.values() if s.family == "prototypes"} == {PrototypeRound.MODEL_KEY}
    assert {s.name for s in METHODS.values() if s.family == "prototypes"} == set(PROTOTYPE_METHODS)
