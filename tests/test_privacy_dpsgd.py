"""DP-SGD (dp-mode = sample): per-sample clipping and noise against a hand-computed step, the Release it
composes, and the refusal of cross-sample layers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pollen.privacy.accounting import Release
from pollen.privacy.dpsgd import dp_sgd, refuse_cross_sample_layers
from pollen.privacy.sample import steps_and_rate

torch.set_num_threads(1)


def ce(model, x, y):
    return F.cross_entropy(model(x), y)


def tiny(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def data(n=20):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 6, generator=g) * 3, torch.randint(0, 3, (n,), generator=g)


@pytest.mark.parametrize(("clip", "sigma"), [(1e3, 1e-6), (0.05, 0.7)])
def test_one_step_is_the_clipped_per_sample_mean_plus_noise(clip, sigma):
    x, y = data()
    model, reference = tiny(), tiny()
    lr, batch = 0.5, 5
    release = dp_sgd(model, x, y, loss=ce, epochs=1, batch_size=batch,
                     optimizer=torch.optim.SGD(model.parameters(), lr), clip=clip, noise_multiplier=sigma,
                     device=torch.device("cpu"), generator=torch.Generator().manual_seed(7))
    assert release == Release(sigma, 0.25, 4)
    # replay: the same Poisson draws, per-sample gradients one by one with autograd, clipped, summed
    g = torch.Generator().manual_seed(7)
    opt = torch.optim.SGD(reference.parameters(), lr)
    clipped_any = False
    for _ in range(4):
        idx = torch.nonzero(torch.rand(20, generator=g) < 0.25).squeeze(1)
        total = [torch.zeros_like(p) for p in reference.parameters()]
        for i in idx:
            grads = torch.autograd.grad(ce(reference, x[i:i + 1], y[i:i + 1]), list(reference.parameters()))
            norm = torch.sqrt(sum((gr ** 2).sum() for gr in grads))
            clipped_any |= bool(norm > clip)
            scale = min(1.0, clip / float(norm))
            total = [t + scale * gr for t, gr in zip(total, grads)]
        for p, t in zip(reference.parameters(), total):
            p.grad = (t + torch.normal(0.0, sigma * clip, size=p.shape, generator=g)) / (0.25 * 20)
        opt.step()
    assert clipped_any == (clip < 1)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, r, atol=1e-6, rtol=1e-5)


def test_the_noise_has_std_sigma_clip_over_the_expected_batch():
    x, y = data(400)
    model = torch.nn.Linear(6, 3, bias=False)
    start = model.weight.detach().clone()
    zero = lambda m, xb, yb: (m(xb) * 0.0).sum()  # noqa: E731 - no signal: the update is the noise
    dp_sgd(model, x, y, loss=zero, epochs=1, batch_size=400, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
           clip=2.0, noise_multiplier=3.0, device=torch.device("cpu"), generator=torch.Generator().manual_seed(0))
    step = (model.weight.detach() - start).flatten()  # q = 1: one step, noise / (q·n)
    assert step.std().item() == pytest.approx(3.0 * 2.0 / 400, rel=0.5)  # 18 draws only
    big = torch.nn.Linear(200, 100, bias=False)
    start = big.weight.detach().clone()
    dp_sgd(big, torch.randn(400, 200), y, loss=zero, epochs=1, batch_size=400,
           optimizer=torch.optim.SGD(big.parameters(), lr=1.0), clip=2.0, noise_multiplier=3.0,
           device=torch.device("cpu"), generator=torch.Generator().manual_seed(0))
    assert (big.weight.detach() - start).std().item() == pytest.approx(3.0 * 2.0 / 400, rel=0.03)  # 20,000 draws


def test_batchnorm_is_refused_naming_the_layer_and_the_fix():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4))
    with pytest.raises(ValueError, match=r"model 'resnet10' has layer '1' \(BatchNorm2d\).*GroupNorm.*'payload'"):
        refuse_cross_sample_layers(model, "resnet10")
    refuse_cross_sample_layers(tiny(), "mlp")  # nothing to refuse


def test_steps_and_rate():
    assert steps_and_rate(100, 32, 2) == (8, 0.32)
    assert steps_and_rate(10, 32, 1) == (1, 1.0)
    with pytest.raises(ValueError, match="record"):
        steps_and_rate(0, 32, 1)


# -- no dataset statistic in a per-sample loss -------------------------------------------------------------
def test_dp_sgd_refuses_a_loss_built_from_a_statistic_of_the_dataset():
    x, y = data()
    model = tiny()
    with pytest.raises(ValueError, match=r"statistic of the dataset \(neg: the client's own classes"):
        dp_sgd(model, x, y, loss=ce, epochs=1, batch_size=5, optimizer=torch.optim.SGD(model.parameters(), 0.1),
               clip=1.0, noise_multiplier=1.0, device=torch.device("cpu"),
               statistics=("neg: the client's own classes, read off its training labels",))


def test_bd_fedproto_negatives_name_the_dataset_statistic_only_when_read_off_the_labels():
    """BD-FedProto's contrastive negatives are the classes a client does not hold: fixed by the task's
    plan (shot splits, Dirichlet: every class) they are public; read off a user-data client's labels they
    are a statistic of its dataset, which train_terms hands to DP-SGD (which refuses it)."""
    from pollen.methods.prototypes import ContrastiveNegatives, PrototypeTargets

    glob = PrototypeTargets(torch.zeros(4, 3), torch.tensor([True, True, True, False]), 1.0)
    planned = ContrastiveNegatives(glob, (0, 1), "hinge", 0.5, 1.0)
    read = ContrastiveNegatives(glob, (0, 1), "hinge", 0.5, 1.0, classes_from_data=True)
    assert planned.data_statistics == () and read.data_statistics == (
        "the client's own classes, read off its training labels",)


def test_sample_mode_bd_fedproto_on_user_data_is_refused_before_start(tmp_path):
    from pollen.app.config import ConfigError, parse_run_config
    from tests.test_user_data import DIGITS, write_image_folder

    write_image_folder(tmp_path, "mnist", DIGITS, {"train": 8, "test": 2})
    rc = {"method": "bd-fedproto", "task": "image-folder", "data-dir": str(tmp_path), "model": "cnn_mnist",
          "dp-mode": "sample", "dp-noise-multiplier": 1.0, "fraction-evaluate": 0.0}
    with pytest.raises(ConfigError, match="read off the client's labels.*proto-cpa = false.*dp-mode = 'payload'"):
        parse_run_config(rc)
    assert parse_run_config({**rc, "proto-cpa": False}).dp_mode == "sample"
    assert parse_run_config({**rc, "method": "fedproto"}).dp_mode == "sample"  # no negatives: nothing read
