"""Local ImageNet ResNet weights for FedProto's CIFAR-10 setup: what loads, what is refused, and the client path."""

import pytest
import torch
import torchvision

from pollen.app.config import ConfigError, parse_node_config, parse_run_config
from pollen.app.registry import METHODS
from pollen.models import build_model, to_channels_last
from pollen.models.pretrained import PretrainedWeightsError, load_stage_weights
from tests.conftest import make_context

torch.set_num_threads(1)


def _imagenet_file(tmp_path, depth=18, wrap=False):
    net = getattr(torchvision.models, f"resnet{depth}")()
    state = net.state_dict()
    if wrap:  # a training checkpoint: {'state_dict': {'module.<key>': ...}}
        state = {"state_dict": {f"module.{k}": v for k, v in state.items()}}
    path = tmp_path / f"resnet{depth}.pth"
    torch.save(state, path)
    return net, path


@pytest.mark.parametrize("wrap", [False, True])
def test_stages_load_by_name_and_the_stem_and_head_stay_fresh(tmp_path, wrap):
    net, path = _imagenet_file(tmp_path, wrap=wrap)
    model = to_channels_last(build_model("resnet18", 10, in_channels=3, image_size=32, width=1.0))
    stem_before = model.conv1.weight.detach().clone()
    head_before = model.head.weight.detach().clone()
    loaded = load_stage_weights(model, path)
    expected = [k for k in net.state_dict() if k.split(".")[0] not in ("conv1", "bn1", "fc")]
    assert loaded == len(expected) > 100
    ours = model.state_dict()
    for k in expected:
        assert torch.equal(ours[k], net.state_dict()[k]), k
    assert torch.equal(model.conv1.weight, stem_before) and torch.equal(model.head.weight, head_before)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_files_that_do_not_fit_are_refused_before_anything_is_copied(tmp_path):
    _, path34 = _imagenet_file(tmp_path, depth=34)
    model = build_model("resnet18", 10, in_channels=3, image_size=32, width=1.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PretrainedWeightsError, match="keys the model lacks"):
        load_stage_weights(model, path34)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    _, path18 = _imagenet_file(tmp_path)
    with pytest.raises(PretrainedWeightsError, match="shape mismatches.*model-width = 1"):
        load_stage_weights(build_model("resnet18", 10, in_channels=3, image_size=32, width=0.5), path18)
    with pytest.raises(PretrainedWeightsError, match="does not exist"):
        load_stage_weights(model, tmp_path / "nope.pth")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(PretrainedWeightsError, match="cannot read"):
        load_stage_weights(model, tmp_path / "junk.pth")


def test_fedproto_client_starts_from_the_file_once_then_from_its_own_state(tmp_path):
    net, path = _imagenet_file(tmp_path)
    rc = {"method": "fedproto", "task": "uci-dirichlet", "model": "resnet18", "model-width": 1.0,
          "max-train-samples": 8, "batch-size": 4, "lr": 0.01, "proto-pretrained": str(path)}
    cfg = parse_run_config(rc)
    ctx = make_context(rc, 0, 2)
    client = METHODS["fedproto"].make_client(cfg, parse_node_config(ctx.node_config), ctx)
    model = client.load_model()
    key = "layer2.0.conv1.weight"
    assert torch.equal(model.state_dict()[key].cpu(), net.state_dict()[key])
    client.fit([], {"server-round": 1})  # trains and stores the private model
    again = METHODS["fedproto"].make_client(cfg, parse_node_config(ctx.node_config), ctx).load_model()
    assert not torch.equal(again.state_dict()[key].cpu(), net.state_dict()[key])  # state wins over the file


def test_run_config_refuses_pretrained_weights_for_models_they_cannot_fit():
    with pytest.raises(ConfigError, match="proto-pretrained"):
        parse_run_config({"method": "fedproto", "task": "uci-dirichlet", "proto-pretrained": "/x/resnet18.pth"})
    with pytest.raises(ConfigError, match="proto-pretrained"):
        parse_run_config({"method": "fedproto", "proto-pretrained": 3})
