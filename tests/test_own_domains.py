"""FCCL on your own domains: task ``image-domains`` with a public folder of your own unlabeled images.

Domains are real MNIST digits, one folder each: ``plain`` as stored, ``inverted`` (255 − x, white
background) and ``thick`` (a 3×3 maximum filter: bold strokes) — a domain shift a model trained on one
does not survive. The public set is a folder of real Fashion-MNIST images (no labels, no digits).

* pure: reading, counting and fingerprinting a public folder; resolving the task; clear errors;
* simulation (`flwr run`): run key ``data-dir`` holds the three domain folders, so every client also
  tests on the others (intra- and inter-domain accuracy);
* fleet: a SuperLink and three SuperNodes, each given only its own domain folder, its own *copy* of
  the public folder and its own architecture (node config ``data-dir``, ``public-dir``, ``model``); FCCL
  runs to the end, each node's model classifies its own test images with ``pollen predict``;
* in process (the ServerApp and real ClientApps, no launch): one node's public copy differs, and the
  server refuses that node's logits by name while the others train.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageFilter, ImageOps

from pollen.app.config import ConfigError, parse_node_config, parse_run_config
from pollen.datasets.public import load_public, public_digest
from pollen.datasets.sources import load_source
from pollen.datasets.spec import TaskOptions
from pollen.datasets.tasks import TaskError, build_client_data, resolve_task
from pollen.datasets.user_data import UserDataError, count_unlabeled_images, read_unlabeled_folder
from tests.conftest import PROJECT_ROOT, RAY_CPUS, require_real_data
from tests.test_user_data import write_image_folder

CLASSES = {"zero": 0, "one": 1, "two": 2}
DOMAINS = ("inverted", "plain", "thick")  # sorted: partition i serves DOMAINS[i] under run key data-dir
TRAIN, TEST = (20, 24, 28), (6, 7, 8)  # per class; different per domain, so counts tell folders apart
N0 = 40  # public images
AGREED = {"method": "fccl", "task": "image-domains", "classes": "zero,one,two", "image-size": 28, "image-channels": 1,
          "fccl-public": "folder", "fccl-public-size": N0, "fccl-public-batch-size": 20, "fccl-solo-epochs": 2,
          "fccl-local-epochs": "1", "fccl-batch-size": 16, "model": "resnet10", "model-width": 0.125, "seed": 1}
ACC = re.compile(r"accuracy: ([0-9.]+) \((\d+)/(\d+)\)")


def _restyle(folder: Path, domain: str) -> None:
    for path in folder.rglob("*.png"):
        with Image.open(path) as img:
            img.load()
        if domain == "inverted":
            img = ImageOps.invert(img)
        elif domain == "thick":
            img = img.filter(ImageFilter.MaxFilter(3))
        img.save(path)


def write_public(folder: Path, count: int, offset: int = 0) -> Path:
    """``count`` real Fashion-MNIST training images as PNG files in two sub-folders (no labels)."""
    data = load_source("fashion_mnist", require_real_data(), "train")
    for k in range(count):
        sub = folder / ("a" if k % 2 else "b")
        sub.mkdir(parents=True, exist_ok=True)
        Image.fromarray(data.images[offset + k, 0].numpy()).save(sub / f"img-{k:04d}.png")
    return folder


@pytest.fixture(scope="module")
def domains(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("domains")
    for i, domain in enumerate(DOMAINS):
        write_image_folder(base / domain, "mnist", CLASSES, {"train": TRAIN[i], "test": TEST[i]}, offset=300 * i)
        _restyle(base / domain, domain)
    return base


@pytest.fixture(scope="module")
def public(tmp_path_factory) -> Path:
    return write_public(tmp_path_factory.mktemp("public") / "unlabeled", N0)


# ---------------------------------------------------------------------------------- pure
def test_public_folder_is_read_in_path_order_and_fingerprinted(public, tmp_path):
    images = read_unlabeled_folder(str(public))
    assert len(images) == N0 == count_unlabeled_images(str(public))
    assert (images.labels == -1).all() and tuple(images.images.shape[1:]) == (1, 28, 28)
    # path order: a/img-0001, a/img-0003, …, b/img-0000, …: the first is Fashion-MNIST train image 1
    fmnist = load_source("fashion_mnist", require_real_data(), "train").images
    # uint8 pixels through lossless PNG: exact by construction
    np.testing.assert_array_equal(images.images[0].numpy(), fmnist[1].numpy())
    np.testing.assert_array_equal(images.images[N0 // 2].numpy(), fmnist[0].numpy())
    copy = shutil.copytree(public, tmp_path / "copy")
    a = load_public("folder", None, 30, seed=3, folder=str(public))
    b = load_public("folder", None, 30, seed=3, folder=str(copy))
    np.testing.assert_array_equal(a.images.numpy(), b.images.numpy())  # byte copies of the same files
    assert public_digest(a.images) == public_digest(b.images)
    assert public_digest(load_public("folder", None, 30, seed=4, folder=str(public)).images) != public_digest(a.images)
    one = next(copy.rglob("*.png"))  # one changed pixel in the copy: another digest
    arr = np.asarray(Image.open(one)).copy()
    arr[0, 0] ^= 1
    Image.fromarray(arr).save(one)
    read_unlabeled_folder.cache_clear()
    changed = load_public("folder", None, N0, seed=3, folder=str(copy))
    assert public_digest(changed.images) != public_digest(load_public("folder", None, N0, 3, folder=str(public)).images)


def test_bad_public_folders_fail_by_name(tmp_path, public):
    with pytest.raises(ValueError, match="holds 40 images, fewer than the 41 asked for"):
        load_public("folder", None, N0 + 1, seed=0, folder=str(public))
    with pytest.raises(ValueError, match="needs a folder"):
        load_public("folder", None, 5, seed=0)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserDataError, match="holds no images"):
        read_unlabeled_folder(str(empty))
    mixed = shutil.copytree(public, tmp_path / "mixed")
    Image.new("L", (32, 32)).save(mixed / "b" / "big.png")
    with pytest.raises(UserDataError, match=r"big\.png: image is 32x32 .* same size"):
        read_unlabeled_folder(str(mixed))
    (mixed / "b" / "big.png").unlink()
    (mixed / "notes.txt").write_text("x")
    with pytest.raises(UserDataError, match=r"notes\.txt: not an image file"):
        read_unlabeled_folder(str(mixed))


def test_domains_task_resolves_from_the_folders_and_each_client_tests_on_all(domains):
    cfg = parse_run_config({**AGREED, "data-dir": str(domains), "fccl-public-dir": "", "classes": ""})
    spec = resolve_task(cfg.task, TaskOptions.of(cfg))
    assert spec.kind == "domains" and spec.fixed_partitions == 3 and spec.class_names == ("one", "two", "zero")
    data = build_client_data(cfg.task, TaskOptions.of(cfg), 1, 3)
    assert data.domain == "plain" and data.num_train == 3 * TRAIN[1] and len(data.y_test) == 3 * TEST[1]
    assert sorted(data.extra_tests) == ["inverted", "thick"]
    assert len(data.extra_tests["thick"][1]) == 3 * TEST[2]
    with pytest.raises(TaskError, match="holds 3 domain folder.*num-partitions must be 3, got 4"):
        build_client_data(cfg.task, TaskOptions.of(cfg), 0, 4)


def test_a_node_reads_only_its_own_domain_folder(domains):
    cfg = parse_run_config(AGREED)  # no path in the run config: classes and format agreed by keys
    node = parse_node_config({"partition-id": 0, "num-partitions": 1, "data-dir": str(domains / "thick")})
    data = build_client_data(cfg.task, TaskOptions.of(cfg, node), 0, 1)
    assert data.domain == "thick" and data.num_train == 3 * TRAIN[2] and data.extra_tests == {}


def test_domains_config_errors_are_clear(domains, public, tmp_path):
    with pytest.raises(ConfigError, match="'classes'.*empty and there is no run key 'data-dir'"):
        parse_run_config({**AGREED, "classes": ""})
    with pytest.raises(ConfigError, match="holds 40 images, fewer than fccl-public-size = 50"):
        parse_run_config({**AGREED, "fccl-public-dir": str(public), "fccl-public-size": 50})
    with pytest.raises(ConfigError, match="'fccl-public-dir' is read only with fccl-public = 'folder'"):
        parse_run_config({**AGREED, "fccl-public": "photo_patches", "fccl-public-dir": str(public)})
    with pytest.raises(ConfigError, match="'fccl-train-sizes' is for the built-in domain tasks"):
        parse_run_config({**AGREED, "fccl-train-sizes": "10"})
    with pytest.raises(ConfigError, match="node config 'public-dir' = .*no such file or folder"):
        parse_node_config({"partition-id": 0, "num-partitions": 1, "public-dir": str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="method 'fedavg' .*task 'image-domains' is a domain-per-client task"):
        parse_run_config({"method": "fedavg", "task": "image-domains", "data-dir": str(domains)})


# ---------------------------------------------------------------------------------- simulation
@pytest.mark.e2e
def test_fccl_simulation_on_your_own_domains(domains, public, tmp_path):
    from pollen.launch import simulate

    out = tmp_path / "runs"
    keys = " ".join(f"{k}={json.dumps(v)}" for k, v in AGREED.items())
    outcome = simulate(ray_cpus=RAY_CPUS, app_dir=PROJECT_ROOT, flwr_home=tmp_path / "flwr", num_supernodes=3,
                       timeout=900, echo=False,
                       run_config=f"num-server-rounds=2 data-dir='{domains}' "
                                  f"fccl-public-dir='{public}' out-dir='{out}' {keys}")
    assert outcome.completed, outcome.log[-4000:]
    rounds = [json.loads(x) for x in (out / str(outcome.run_id) / "metrics.jsonl").read_text().splitlines()]
    for rec in rounds:
        assert rec["fit"]["accepted"] == 3 and rec["rejected"] == [] and rec["failures"] == 0
        clients = rec["evaluate-clients"]
        for i, domain in enumerate(DOMAINS):
            c = clients[f"partition {i}"]
            assert c["num-examples"] == 3 * TEST[i] and f"acc-{domain}" in c
            assert 0 <= c["inter-accuracy"] <= 1 and 0 <= c["intra-accuracy"] <= 1
    digests = {c["public-digest"] for c in rounds[0]["fit-clients"].values()}
    assert len(digests) == 1
    assert rounds[1]["bytes-down"] >= 3 * N0 * 3 * 4  # the N0×C consensus reached every client in round 2
    assert all("collab-loss" in c for c in rounds[1]["fit-clients"].values())


# ---------------------------------------------------------------------------------- fleet
def _predict(*argv) -> tuple[float, int]:
    proc = subprocess.run([sys.executable, "-m", "pollen.launch.predict", *map(str, argv)], cwd=PROJECT_ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    match = ACC.search(proc.stdout)
    assert match, proc.stdout
    return float(match.group(1)), int(match.group(3))


def _fleet_run(tmp_path, data_dirs, public_dirs, models=()):
    from pollen.launch.fleet import Fleet, compose_run_config, format_config, plan_nodes
    from pollen.launch.processes import groups_alive

    out = tmp_path / "runs"
    values, _ = compose_run_config(method="fccl", rounds=2, out_dir=out, data_root=None,
                                   user=format_config(AGREED), num_supernodes=3)
    with Fleet(tmp_path / "work", echo=False) as fleet:
        for spec in plan_nodes(3, data_dirs=[str(d) for d in data_dirs], public_dirs=[str(p) for p in public_dirs],
                               models=models):
            fleet.add_supernode(spec)
        fleet.wait_for_nodes(3, timeout=240)
        outcome = fleet.run(values, timeout=900, echo=False)
        groups = fleet.process_groups()
        errors = fleet.client_errors()
    assert not groups_alive(groups)
    assert outcome.completed, outcome.log[-4000:]
    assert errors == {}
    return out / str(outcome.run_id)


FLEET_MODELS = ("resnet10", "resnet12", "mobilenet_v2")  # node config `model`: one architecture per node


@pytest.mark.e2e
def test_fccl_fleet_where_every_node_holds_its_own_domain_public_copy_and_architecture(domains, public, tmp_path):
    """FCCL on a real fleet (its only fleet test): three SuperNodes, each with its own domain folder, its own copy
    of the public folder and its own architecture, two rounds; each node's model scores its own test split with
    ``pollen predict`` as its last evaluation did."""
    sites = []
    for i, domain in enumerate(DOMAINS):  # each site: its own domain folder and its own public copy
        site = tmp_path / f"site-{i}"
        shutil.copytree(domains / domain, site / domain)
        shutil.copytree(public, site / "public")
        sites.append(site)
    run_dir = _fleet_run(tmp_path, [s / d for s, d in zip(sites, DOMAINS)], [s / "public" for s in sites],
                         models=FLEET_MODELS)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["data-dir"] == "" and config["fccl-public-dir"] == ""  # no path travels with the run
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [rec["round"] for rec in rounds] == [1, 2]
    for rec in rounds:
        assert rec["fit"]["accepted"] == 3 and rec["rejected"] == [] and rec["failures"] == 0
        for i in range(3):
            fit, ev = rec["fit-clients"][f"partition {i}"], rec["evaluate-clients"][f"partition {i}"]
            assert fit["num-examples"] == 3 * TRAIN[i] and ev["num-examples"] == 3 * TEST[i]
            assert "inter-accuracy" not in ev  # other domains' test images never reach a node
    assert all("collab-loss" in c for c in rounds[1]["fit-clients"].values())
    assert rounds[0]["bytes-down"] < rounds[1]["bytes-down"]  # round 1 sends no consensus yet
    last = rounds[-1]
    for i, (site, domain) in enumerate(zip(sites, DOMAINS)):
        state = run_dir / "nodes" / f"partition-{i}"
        meta = json.loads((state / "final-model.json").read_text())
        assert meta["data-dir"] == str((site / domain).resolve()) and meta["class-names"] == list(CLASSES)
        assert meta["model"] == FLEET_MODELS[i]
        acc, n = _predict("--model", state / "final-model.safetensors", "--data-dir", site / domain)
        assert n == 3 * TEST[i]
        assert abs(acc - last["evaluate-clients"][f"partition {i}"]["intra-accuracy"]) <= 1e-6


def test_the_server_refuses_by_name_the_logits_of_a_node_whose_public_copy_differs(domains, public, tmp_path):
    """The ServerApp and three real ClientApps in this process (no launch: the refusal is the server's, and
    the fleet test above already carries node config ``public-dir`` through Flower): node 2's node config
    names a public folder of other Fashion-MNIST images, so each round its logits are refused by name while
    the other two train."""
    from flwr.app import Context, RecordDict

    from pollen.app.client_app import app as client_app
    from pollen.app.server_app import main as server_main
    from pollen.testing import InProcessGrid, clientapp_node

    other = write_public(tmp_path / "other-public", N0, offset=1000)  # node 2: other Fashion-MNIST images
    config = {**AGREED, "num-server-rounds": 2}
    grid = InProcessGrid({100 + i: clientapp_node(client_app, config, i, 3, state_dir=str(tmp_path / f"p{i}"),
                                                  node_config={"data-dir": str(domains / d), "public-dir": str(pub)})
                          for i, (d, pub) in enumerate(zip(DOMAINS, [public, public, other]))})
    server_main(grid, Context(run_id=7, node_id=0, node_config={}, state=RecordDict(),
                              run_config={**config, "out-dir": str(tmp_path / "runs"), "run-name": "refusal"}))
    run_dir = tmp_path / "runs" / "refusal"
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    rounds = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [rec["round"] for rec in rounds] == [1, 2]
    for rec in rounds:
        assert rec["fit"]["accepted"] == 2 and sorted(rec["fit-clients"]) == ["partition 0", "partition 1"]
        [rejected] = rec["rejected"]
        assert rejected["client"] == "partition 2"
        assert "its logits are on other public images" in rejected["reason"]
