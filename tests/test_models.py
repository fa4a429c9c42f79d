"""Model zoo: the SplitModel contract, paper sizes, trainability, head growth, seeded LeNet."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pollen.models import (
    MODEL_NAMES,
    CNNMnist,
    LeNet,
    SplitModel,
    build_model,
    scale_channels,
    to_channels_last,
)

torch.set_num_threads(1)

TINY = 0.125


def _input_spec(name: str) -> dict:
    """FedProto's CNN runs on 1×28×28 MNIST; everything else on 3×32×32."""
    if name == "cnn_mnist":
        return {"in_channels": 1, "image_size": 28}
    return {"in_channels": 3, "image_size": 32}


def _batch(name: str, n: int, seed: int = 0) -> torch.Tensor:
    spec = _input_spec(name)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, spec["in_channels"], spec["image_size"], spec["image_size"], generator=g)


def _tiny(name: str, num_classes: int = 5) -> SplitModel:
    torch.manual_seed(0)
    return build_model(name, num_classes, width=TINY, **_input_spec(name))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_split_contract(name):
    model = _tiny(name, num_classes=7).eval()
    x = _batch(name, 3)
    with torch.no_grad():
        z = model.features(x)
        logits = model.classify(z)
        out = model(x)
    assert isinstance(model, SplitModel)
    assert z.shape == (3, model.feature_dim)
    assert logits.shape == (3, 7) and model.num_classes == 7
    assert torch.equal(out, logits)
    assert torch.isfinite(out).all()
    model.train()
    assert model(x).shape == (3, 7)


PAPER_FEATURE_DIMS = {
    "resnet10": 512,
    "resnet12": 512,
    "resnet18": 512,
    "resnet34": 512,
    "efficientnet_b0": 320,
    "mobilenet_v2": 1280,
    "googlenet": 1024,
    "cnn_mnist": 50,
    "lenet": 768,
}


def test_paper_feature_dims_cover_all_models():
    assert set(PAPER_FEATURE_DIMS) == set(MODEL_NAMES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_full_width_feature_dims(name):
    num_classes = 100 if name == "lenet" else 10
    model = build_model(name, num_classes, **_input_spec(name))
    assert model.feature_dim == PAPER_FEATURE_DIMS[name]
    assert model.head.in_features == PAPER_FEATURE_DIMS[name]
    assert model.head.out_features == num_classes


def test_full_width_stage_sizes():
    # CIFAR ResNet: 3×3 stride-1 stem to 64 channels, stages 64/128/256/512, depths per variant.
    depths = {
        "resnet10": (1, 1, 1, 1),
        "resnet12": (2, 1, 1, 1),
        "resnet18": (2, 2, 2, 2),
        "resnet34": (3, 4, 6, 3),
    }
    for name, expected in depths.items():
        m = build_model(name, 10)
        assert m.conv1.kernel_size == (3, 3) and m.conv1.stride == (1, 1) and m.conv1.out_channels == 64
        stages = [m.layer1, m.layer2, m.layer3, m.layer4]
        assert tuple(len(s) for s in stages) == expected
        assert [s[-1].conv2.out_channels for s in stages] == [64, 128, 256, 512]
    mnist = build_model("cnn_mnist", 10, in_channels=1, image_size=28)
    assert (mnist.conv1.out_channels, mnist.conv2.out_channels, mnist.fc1.in_features) == (10, 20, 320)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_sgd_steps_reduce_loss_on_fixed_batch(name):
    if name == "cnn_mnist":
        # Already tiny at full width; its 0.5 dropouts make 10 steps on 8 noise images too noisy
        # to show progress, so the gradient path is checked without them (dropout tested below).
        torch.manual_seed(0)
        model = build_model(name, 4, dropout=0.0, **_input_spec(name)).train()
    else:
        model = _tiny(name, num_classes=4).train()
    x = _batch(name, 8, seed=1)
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def loss_now() -> float:
        torch.manual_seed(123)  # identical dropout masks for both measurements
        with torch.no_grad():
            return F.cross_entropy(model(x), y).item()

    before = loss_now()
    for step in range(10):
        torch.manual_seed(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    after = loss_now()
    assert math.isfinite(after)
    assert after < 0.8 * before, (before, after)


def test_grow_classes_keeps_old_logits():
    model = _tiny("resnet10", num_classes=10).eval()
    x = _batch("resnet10", 4)
    with torch.no_grad():
        old = model(x)
    old_head = model.head
    model.grow_classes(15)
    with torch.no_grad():
        new = model(x)
    assert model.num_classes == 15 and new.shape == (4, 15)
    assert model.head is not old_head
    # Old weights are copied bit for bit (checked exactly); the logits come from a GEMM of another
    # shape, whose kernels may sum in another order, so they agree to float32 rounding only.
    assert torch.equal(model.head.weight[:10], old_head.weight)
    assert torch.equal(model.head.bias[:10], old_head.bias)
    torch.testing.assert_close(new[:, :10], old, rtol=1e-5, atol=1e-6)
    assert not torch.equal(model.head.weight[10:], torch.zeros_like(model.head.weight[10:]))
    model.grow_classes(15)  # same size: unchanged
    assert model.num_classes == 15
    with pytest.raises(ValueError, match="new_num_classes"):
        model.grow_classes(12)


def test_grow_classes_keeps_train_mode_and_grads_flow():
    model = _tiny("resnet12", num_classes=3).train()
    model.grow_classes(6)
    assert model.head.training
    out = model(_batch("resnet12", 2))
    out[:, 5].sum().backward()
    assert model.head.weight.grad is not None and model.head.weight.grad[5].abs().sum() > 0


def test_lenet_seeded_identical_weights():
    torch.manual_seed(1)
    a = LeNet(100, seed=7)
    torch.manual_seed(2)  # the global RNG must not matter
    b = build_model("lenet", 100, seed=7)
    c = LeNet(100, seed=8)
    d = LeNet(100, generator=torch.Generator().manual_seed(7))
    sa, sb, sc, sd = (m.state_dict() for m in (a, b, c, d))
    assert list(sa) == list(sb)
    assert all(torch.equal(sa[k], sb[k]) and torch.equal(sa[k], sd[k]) for k in sa)
    assert all(not torch.equal(sa[k], sc[k]) for k in sa)
    for p in a.parameters():
        assert p.min() >= -0.5 and p.max() <= 0.5
    # A uniform draw over the range, not a narrow default init: spread close to ±0.5.
    w = a.head.weight
    assert w.min() < -0.49 and w.max() > 0.49
    assert abs(w.mean().item()) < 0.01


def test_lenet_matches_hand_forward_and_dlg_shape():
    net = LeNet(100)
    convs = [m for m in net.body if isinstance(m, torch.nn.Conv2d)]
    assert [c.stride for c in convs] == [(2, 2), (2, 2), (1, 1)]
    assert all(c.kernel_size == (5, 5) and c.padding == (2, 2) and c.out_channels == 12 for c in convs)
    assert net.head.in_features == 768 and net.head.out_features == 100
    x = _batch("lenet", 2)
    h = x
    for c in convs:
        h = torch.sigmoid(F.conv2d(h, c.weight, c.bias, stride=c.stride, padding=2))
    assert h.shape == (2, 12, 8, 8)
    expected = h.reshape(2, -1) @ net.head.weight.T + net.head.bias
    torch.testing.assert_close(net(x), expected)


def test_lenet_supports_second_order_gradients():
    # The GLFC proxy matches gradients (DLG): it needs d/dx of a gradient norm.
    net = LeNet(10)
    dummy = torch.randn(1, 3, 32, 32, requires_grad=True)
    loss = F.cross_entropy(net(dummy), torch.tensor([3]))
    grads = torch.autograd.grad(loss, list(net.parameters()), create_graph=True)
    match = sum((g**2).sum() for g in grads)
    (dx,) = torch.autograd.grad(match, dummy)
    assert dx.abs().sum() > 0


@pytest.mark.parametrize("channels", [18, 20, 22])
def test_cnn_mnist_heterogeneous_channels(channels):
    model = build_model("cnn_mnist", 10, in_channels=1, image_size=28, channels=channels).eval()
    assert model.conv2.out_channels == channels
    assert model.fc1.in_features == channels * 4 * 4  # 28 -conv5-> 24 -pool-> 12 -conv5-> 8 -pool-> 4
    z = model.features(_batch("cnn_mnist", 3))
    assert z.shape == (3, 50) and (z >= 0).all()  # ReLU embedding


@pytest.mark.parametrize("in_channels", [1, 3])
def test_cnn_mnist_other_input_sizes(in_channels):
    model = CNNMnist(10, in_channels=in_channels, image_size=32).eval()
    assert model.fc1.in_features == 20 * 5 * 5  # 32 -> 28 -> 14 -> 10 -> 5
    assert model(torch.randn(2, in_channels, 32, 32)).shape == (2, 10)


def test_cnn_mnist_dropout_only_in_train_mode():
    model = CNNMnist(10)
    x = _batch("cnn_mnist", 4)
    model.train()
    assert not torch.equal(model(x), model(x))
    model.eval()
    assert torch.equal(model(x), model(x))


def test_cnn_mnist_matches_hand_forward():
    model = CNNMnist(10).eval()
    x = _batch("cnn_mnist", 2)
    h = F.relu(F.max_pool2d(F.conv2d(x, model.conv1.weight, model.conv1.bias), 2))
    h = F.relu(F.max_pool2d(F.conv2d(h, model.conv2.weight, model.conv2.bias), 2))
    z = F.relu(h.reshape(2, -1) @ model.fc1.weight.T + model.fc1.bias)
    torch.testing.assert_close(model.features(x), z)
    torch.testing.assert_close(model(x), z @ model.head.weight.T + model.head.bias)


def test_parameter_counts():
    # CIFAR ResNet-18, 10 classes, by hand (conv weights have no bias; BN has weight + bias):
    #   stem    3·64·9 + 2·64                                               =     1,856
    #   layer1  2 blocks × (2·64·64·9 + 2·2·64)                             =   147,968
    #   layer2  128·64·9 + 128·128·9 + 64·128 + 3·2·128 + 2·128·128·9 + 2·2·128 = 525,568
    #   layer3  (same pattern with 256)                                     = 2,099,712
    #   layer4  (same pattern with 512)                                     = 8,393,728
    #   fc      512·10 + 10                                                 =     5,130
    #   total                                                               = 11,173,962
    resnet18 = build_model("resnet18", 10)
    assert sum(p.numel() for p in resnet18.parameters()) == 11_173_962
    # CNNMnist, 1 input channel, 10 classes:
    #   conv1 1·10·5·5 + 10 = 260; conv2 10·20·5·5 + 20 = 5,020;
    #   fc1 320·50 + 50 = 16,050; fc2 50·10 + 10 = 510;  total 21,840
    mnist = build_model("cnn_mnist", 10, in_channels=1, image_size=28)
    assert sum(p.numel() for p in mnist.parameters()) == 21_840


def test_scale_channels():
    assert scale_channels(64, 1.0) == 64
    assert scale_channels(1280, 1.0) == 1280
    assert scale_channels(64, 0.125) == 8
    assert scale_channels(20, 0.125) == 4  # 2.5 -> floor of 4 channels
    assert scale_channels(40, 0.5) == 20
    assert scale_channels(24, 0.25) == 6
    assert scale_channels(100, 0.125) == 13  # 12.5 rounds half up
    tiny = build_model("resnet18", 10, width=TINY)
    assert tiny.feature_dim == 64 and tiny.conv1.out_channels == 8


def test_bad_arguments_name_allowed_values():
    with pytest.raises(ValueError) as err:
        build_model("resnet50", 10)
    assert all(n in str(err.value) for n in MODEL_NAMES)
    for width in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="width"):
            build_model("resnet10", 10, width=width)
    for n in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="num_classes"):
            build_model("resnet10", n)
    with pytest.raises(ValueError, match="in_channels"):
        build_model("googlenet", 10, in_channels=0)
    with pytest.raises(ValueError, match="allowed: channels, dropout"):
        build_model("cnn_mnist", 10, seed=3)
    with pytest.raises(ValueError, match="allowed: none"):
        build_model("resnet18", 10, channels=3)
    with pytest.raises(ValueError, match="image_size"):
        build_model("cnn_mnist", 10, in_channels=1, image_size=12)


def test_efficientnet_drop_connect_schedule():
    default = build_model("efficientnet_b0", 10, width=TINY)
    assert default.head_dropout == 0.2
    assert all(b.drop_rate == 0.0 for b in default.layers)
    paper = build_model("efficientnet_b0", 10, width=TINY, drop_connect_rate=0.2)
    rates = [b.drop_rate for b in paper.layers]
    assert len(rates) == 16
    assert rates == pytest.approx([0.2 * i / 16 for i in range(16)])


def test_channels_last_same_outputs():
    model = _tiny("resnet10").eval()
    x = _batch("resnet10", 2)
    with torch.no_grad():
        ref = model(x)
        to_channels_last(model)
        assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
        out = model(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)


def test_a_name_is_registered_once():
    """A second model or task under a taken name is refused, never silently swapped in."""
    from pollen.datasets.tasks import TASKS, register_task
    from pollen.models import register_model

    with pytest.raises(ValueError, match="model 'lenet' is already registered"):
        register_model("lenet", lambda *a, **k: None)
    with pytest.raises(ValueError, match="task 'uci-dirichlet' is already registered"):
        register_task(TASKS["uci-dirichlet"])


def test_a_model_spec_rebuilds_its_model_from_its_json():
    """What pollen predict relies on: the JSON saved beside a model describes it completely."""
    import torch

    from pollen.models import ModelSpec

    spec = ModelSpec("cnn_mnist", 10, in_channels=1, image_size=28, width=1.0, options={"channels": 18})
    assert ModelSpec.from_json(spec.to_json()) == spec
    torch.manual_seed(0)
    first = spec.build().state_dict()
    torch.manual_seed(0)
    again = ModelSpec.from_json(spec.to_json()).build().state_dict()
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    bad = {k: v for k, v in spec.to_json().items() if k != "num-classes"}
    with pytest.raises(ValueError, match="lacks 'num-classes'"):
        ModelSpec.from_json(bad)
