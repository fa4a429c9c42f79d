"""External Flower projects using Pollen (issue 11) and hostile clients against it (issue 19).

Each project under ``tests/external/`` is a separate Flower 1.42 app as another team would write it:
its own ``pyproject.toml``, its own uniquely named package, an ``@app.main()`` ServerApp and
``@app.train()`` / ``@app.evaluate()`` ClientApp in plain numpy (the legacy project: ``server_fn`` and a
``NumPyClient``), importing nothing from Pollen but ``pollen.strategies`` and ``pollen.protocol``.
Every run goes through ``flwr run`` on a SuperLink owned by Pollen's launcher (real Flower, Ray
simulation, 3 SuperNodes, 2 rounds); each ServerApp writes what Flower's ``Result`` and the strategy
returned to the JSON file named by its ``report-path`` run key, and the tests compare it with values
computed here, independently, from the same seeded data.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

EXTERNAL = Path(__file__).resolve().parent / "external"
PROJECTS = sorted(p.name for p in EXTERNAL.iterdir() if (p / "pyproject.toml").is_file())
NODES, ROUNDS = 3, 2
HOSTILE_ROUNDS = 3  # the hostile project's own num-server-rounds: round 3 is the impostor's
RUN_TIMEOUT_S = 600
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# --- helpers ----------------------------------------------------------------------------------------------

def _app_config(project: str) -> dict:
    with (EXTERNAL / project / "pyproject.toml").open("rb") as fh:
        return tomllib.load(fh)["tool"]["flwr"]["app"]["config"]


def _load(project: str, module: str):
    """A project's numpy-only helper module (data generation, local training), loaded by path under a
    private name so nothing here depends on the project being on ``sys.path``."""
    package = next(p for p in (EXTERNAL / project).iterdir() if p.name.startswith("extproj_"))
    name = f"_external_{project}_{module}"
    spec = importlib.util.spec_from_file_location(name, package / f"{module}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def launch(project: str, tmp: Path, **run_config):
    """``simulate`` one external project (private FLWR_HOME under ``tmp``); returns (outcome, report or
    None, seconds)."""
    from pollen.launch import simulate

    report = tmp / f"{project}-report.json"
    started = time.monotonic()
    # ray_cpus=1: one ClientApp actor, the cheapest launch for these tiny runs (tests/conftest.py, RAY_CPUS)
    outcome = simulate(ray_cpus=1, app_dir=EXTERNAL / project, flwr_home=tmp / "flwr-home", num_supernodes=NODES,
                       run_config={"report-path": str(report), **run_config}, timeout=RUN_TIMEOUT_S, echo=False)
    seconds = time.monotonic() - started
    print(f"{project}: {outcome.status} in {seconds:.1f}s (run {outcome.run_id})")
    data = json.loads(report.read_text()) if report.exists() else None
    return outcome, data, seconds


def _array(entry: dict) -> np.ndarray:
    return np.asarray(entry["values"], dtype=entry["dtype"]).reshape(entry["shape"])


def _pooled_prototypes(task, cfg: dict) -> tuple[np.ndarray, np.ndarray, list[np.ndarray], list[np.ndarray]]:
    """Class means over the union of every partition's training data, computed here in float64, plus each
    partition's own class means and counts (what an honest client holds)."""
    seed, classes = int(cfg["data-seed"]), int(cfg["num-classes"])
    features, dim, size = int(cfg["num-features"]), int(cfg["embed-dim"]), int(cfg["train-size"])
    w = task.embedding_matrix(seed, features, dim)
    total, counts = np.zeros((classes, dim)), np.zeros(classes)
    local_means, local_counts = [], []
    for pid in range(NODES):
        x, y = task.partition(seed, pid, 0, size, classes, features)
        emb = np.tanh(x @ w)
        means, held = np.zeros((classes, dim)), np.zeros(classes, dtype=np.int64)
        for c in range(classes):
            rows = emb[y == c]
            total[c] += rows.sum(axis=0)
            counts[c] += len(rows)
            held[c] = len(rows)
            if len(rows):
                means[c] = rows.mean(axis=0)
        local_means.append(means)
        local_counts.append(held)
    return total / counts[:, None], counts, local_means, local_counts


def _median_pair_mse(protos: np.ndarray) -> float:
    n = len(protos)
    return float(np.median([((protos[i] - protos[j]) ** 2).mean() for i in range(n) for j in range(i + 1, n)]))


# --- static: the projects are what an outside team would ship ------------------------------------------------

POLLEN_ALLOWED = ("pollen.strategies", "pollen.protocol", "pollen.secagg")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_there_is_one_external_project_per_family():
    assert PROJECTS == ["hostile_project", "legacy_project", "logits_project", "prototypes_project",
                        "secagg_project", "weights_project"]


@pytest.mark.parametrize("project", PROJECTS)
def test_external_project_is_a_standalone_flower_app(project):
    root = EXTERNAL / project
    data = tomllib.loads((root / "pyproject.toml").read_text())
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{0,31}", data["project"]["name"])  # flwr's FAB name rule
    assert data["project"]["version"] and data["tool"]["flwr"]["app"]["publisher"]
    assert "tool" not in data or "federations" not in data["tool"]["flwr"]  # flwr would rewrite the file
    packages = [p for p in root.iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert len(packages) == 1 and packages[0].name.startswith("extproj_"), packages
    package = packages[0].name
    import pollen

    pollen_top = {p.stem for p in Path(pollen.__file__).parent.iterdir()}
    assert package not in pollen_top | {"pollen", "datasets", "utils", "models", "data"}
    for role, ref in data["tool"]["flwr"]["app"]["components"].items():
        module, _, attr = ref.partition(":")
        assert module.split(".")[0] == package, (role, ref)
        source = root / (module.replace(".", "/") + ".py")
        assert re.search(rf"^{attr} = (ServerApp|ClientApp)\(", source.read_text(), re.M), (role, ref)
    assert "report-path" in data["tool"]["flwr"]["app"]["config"]
    for path in root.rglob("*.py"):
        assert not path.name.startswith("test_"), path  # flwr leaves test_*.py out of the FAB
        for name in _imports(path):
            if name == "pollen" or name.startswith("pollen."):
                assert name.startswith(POLLEN_ALLOWED), f"{path.relative_to(EXTERNAL)} imports {name}"
            assert name.split(".")[0] not in ("torch", "torchvision"), f"{path} imports {name}"


def test_external_package_names_do_not_collide():
    names = [next(p.name for p in (EXTERNAL / proj).iterdir() if p.name.startswith("extproj_")) for proj in PROJECTS]
    assert len(set(names)) == len(names)
    dist_names = [tomllib.loads((EXTERNAL / p / "pyproject.toml").read_text())["project"]["name"] for p in PROJECTS]
    assert len(set(dist_names)) == len(dist_names)


# --- prototypes: PrototypeStrategy + encode_prototype_reply / decode_global_prototypes ----------------------

@pytest.mark.e2e
def test_prototype_project_global_prototypes_are_the_pooled_class_means(tmp_path):
    outcome, report, _ = launch("prototypes_project", tmp_path)
    assert outcome.status == "finished:completed" and outcome.completed, outcome.log[-4000:]
    assert report is not None, outcome.log[-4000:]
    cfg = _app_config("prototypes_project")
    task = _load("prototypes_project", "task")
    expected, counts, local_means, local_counts = _pooled_prototypes(task, cfg)

    arrays = report["arrays"]
    assert set(arrays) == {"prototypes", "present", "margin"}
    protos = _array(arrays["prototypes"])
    assert protos.dtype == np.float32 and protos.shape == (int(cfg["num-classes"]), int(cfg["embed-dim"]))
    np.testing.assert_allclose(protos, expected, atol=2e-6)
    assert _array(arrays["present"]).tolist() == [1] * int(cfg["num-classes"])
    assert _array(arrays["margin"]).shape == (1,)
    assert float(_array(arrays["margin"])[0]) == pytest.approx(_median_pair_mse(expected), rel=1e-5)
    # every class is missing from one partition: the average is over holders only, weighted by counts
    assert all((c == 0).sum() == 1 for c in local_counts[: int(cfg["num-classes"])])

    for rnd in ("1", "2"):
        train = report["train"][rnd]
        assert (train["accepted"], train["rejected"], train["failures"]) == (NODES, 0, 0)
        assert train["classes-present"] == int(cfg["num-classes"])
        rep = report["reports"][rnd]
        assert sorted(rep["fit_clients"]) == [f"partition {p}" for p in range(NODES)]
        assert sorted(rep["evaluate_clients"]) == [f"partition {p}" for p in range(NODES)]
        assert rep["rejected"] == [] and rep["failures"] == []
        assert all(m["num-examples"] == int(cfg["train-size"]) for m in rep["fit_clients"].values())
    # round 1 sends an empty record (decode -> None); round 2 the clients decode the global prototypes:
    # their gap to them is what the pooled means predict
    assert report["train"]["1"]["had-global"] == 0 and report["train"]["2"]["had-global"] == 1
    gaps = []
    for means, held in zip(local_means, local_counts):
        gaps.append(float(((means[held > 0] - expected[held > 0]) ** 2).mean()))
    assert report["train"]["2"]["global-gap"] == pytest.approx(float(np.mean(gaps)), rel=1e-4)
    assert report["train"]["2"]["global-gap"] > 0
    assert report["evaluate"]["2"]["accuracy"] > 0.9  # well separated synthetic classes


# --- logits: LogitAveraging + encode_logit_reply / decode_consensus ------------------------------------------

@pytest.mark.e2e
def test_logit_project_consensus_is_the_mean_of_the_clients_logits(tmp_path):
    dump = tmp_path / "client-dump"
    outcome, report, _ = launch("logits_project", tmp_path, **{"dump-dir": str(dump)})
    assert outcome.status == "finished:completed" and outcome.completed, outcome.log[-4000:]
    assert report is not None, outcome.log[-4000:]
    cfg = _app_config("logits_project")
    shape = (int(cfg["public-size"]), int(cfg["num-classes"]))

    sent = {r: [np.load(dump / f"sent-r{r}-p{p}.npy") for p in range(NODES)] for r in (1, 2)}
    assert all(a.shape == shape and a.dtype == np.float32 for r in sent for a in sent[r])
    mean = {r: np.mean([a.astype(np.float64) for a in sent[r]], axis=0) for r in sent}
    assert not np.allclose(sent[1][0], sent[1][1])  # clients really differ, so the mean is a real test

    assert set(report["arrays"]) == {"consensus", "contributors"}
    consensus = _array(report["arrays"]["consensus"])
    assert consensus.dtype == np.float32 and consensus.shape == shape
    np.testing.assert_allclose(consensus, mean[2], atol=1e-6)
    assert _array(report["arrays"]["contributors"]).tolist() == [NODES]
    for p in range(NODES):
        np.testing.assert_allclose(np.load(dump / f"received-r2-p{p}.npy"), mean[1], atol=1e-6)
        assert json.loads((dump / f"meta-r1-p{p}.json").read_text()) == {"contributors": None, "contributed": False}
        assert json.loads((dump / f"meta-r2-p{p}.json").read_text()) == {"contributors": NODES, "contributed": True}
    assert not (dump / "received-r1-p0.npy").exists()  # round 1: empty record, decode_consensus -> None
    for rnd in ("1", "2"):
        assert (report["train"][rnd]["accepted"], report["train"][rnd]["rejected"]) == (NODES, 0)
        assert len(report["reports"][rnd]["evaluate_clients"]) == NODES
        assert 0.0 <= report["evaluate"][rnd]["accuracy"] <= 1.0


# --- weights: WeightAveraging (FedAvg) on named numpy arrays -------------------------------------------------

def _fedavg_reference(task, cfg: dict) -> dict[int, dict[str, np.ndarray]]:
    """Sample-weighted FedAvg computed here: float64 mean cast back to each array's dtype (ints rounded)."""
    seed, features = int(cfg["data-seed"]), int(cfg["num-features"])
    state = task.initial_state(features)
    out = {0: state}
    for rnd in range(1, ROUNDS + 1):
        replies, sizes = [], []
        for pid in range(NODES):
            x, y = task.partition(seed, pid, 0, features)
            new, _loss = task.local_train(state, x, y, int(cfg["local-steps"]), float(cfg["lr"]))
            replies.append(new)
            sizes.append(len(y))
        weights = np.asarray(sizes, dtype=np.float64) / sum(sizes)
        state = {}
        for key, ref in replies[0].items():
            acc = sum(w * r[key].astype(np.float64) for w, r in zip(weights, replies))
            state[key] = np.rint(acc).astype(ref.dtype) if ref.dtype.kind in "iu" else acc.astype(ref.dtype)
        out[rnd] = state
    return out


@pytest.mark.e2e
def test_weights_project_matches_an_independent_fedavg(tmp_path):
    outcome, report, _ = launch("weights_project", tmp_path)
    assert outcome.status == "finished:completed" and outcome.completed, outcome.log[-4000:]
    assert report is not None, outcome.log[-4000:]
    cfg = _app_config("weights_project")
    task = _load("weights_project", "task")
    reference = _fedavg_reference(task, cfg)
    assert len({task.train_size(p) for p in range(NODES)}) == NODES  # unequal sizes: weighting matters

    assert sorted(report["per-round-arrays"]) == ["0", "1", "2"]
    for rnd in range(ROUNDS + 1):
        got = report["per-round-arrays"][str(rnd)]
        assert set(got) == set(reference[rnd])
        for key, want in reference[rnd].items():
            arr = _array(got[key])
            assert arr.dtype == want.dtype and arr.shape == want.shape, key
            np.testing.assert_allclose(arr, want, atol=1e-6, err_msg=f"round {rnd} {key}")
    for key, want in reference[ROUNDS].items():
        np.testing.assert_allclose(_array(report["arrays"][key]), want, atol=1e-6)
    assert _array(report["arrays"]["step-count"]).shape == ()  # 0-d int stays 0-d on the wire
    assert int(_array(report["arrays"]["step-count"])) == ROUNDS * int(cfg["local-steps"])

    for rnd in ("1", "2"):
        train = report["train"][rnd]
        assert (train["accepted"], train["rejected"], train["failures"]) == (NODES, 0, 0)
        fit = report["reports"][rnd]["fit_clients"]
        assert {k: v["num-examples"] for k, v in fit.items()} == {
            f"partition {p}": task.train_size(p) for p in range(NODES)}
    assert report["train"]["2"]["train-loss"] < report["train"]["1"]["train-loss"]
    assert report["evaluate"]["2"]["loss"] < report["evaluate"]["1"]["loss"]
    assert report["evaluate"]["2"]["accuracy"] > 0.7


# --- hostile clients (issues 19, 31): the run completes, every bad reply is rejected with its reason, a bad
# reported metric is dropped alone (issue 32) -------------------------------------------------------------------

@pytest.fixture(scope="module")
def hostile_run(tmp_path_factory):
    return launch("hostile_project", tmp_path_factory.mktemp("hostile"), scenario="hostile")


@pytest.mark.e2e
def test_hostile_clients_are_rejected_with_reasons_and_the_run_completes(hostile_run):
    outcome, report, _ = hostile_run
    assert outcome.status == "finished:completed" and outcome.completed, outcome.log[-4000:]
    assert outcome.leftover == []
    assert report is not None, outcome.log[-4000:]
    cfg = _app_config("hostile_project")
    reps = report["reports"]

    def reasons(rnd: str, stage: str) -> list[str]:
        return sorted(r["reason"] for r in reps[rnd]["rejected"] if r["stage"] == stage)

    def rejected_clients(rnd: str, stage: str) -> set[str]:
        return {r["client"] for r in reps[rnd]["rejected"] if r["stage"] == stage}

    # round 1 train: partition 1 claims 10**15 examples, partition 2 sends a NaN partition id
    r1 = reasons("1", "train")
    assert len(r1) == 2, r1
    assert re.fullmatch(r"metric 'num-examples' = 1000000000000000 is above 1e\+07", r1[0]), r1
    assert re.fullmatch(r"metric 'partition-id' = nan is not a finite number", r1[1]), r1
    # round 2 train: partition 2 pads 'w' to 50 MB; partition 1 sends 3e38 everywhere (finite float32), unclaimed
    r2 = reasons("2", "train")
    assert len(r2) == 2, r2
    assert r2[0] == f"'w': {50_000_000 + 144} bytes for a 4 float32 array", r2
    assert re.fullmatch(r"update norm [0-9.]+e\+38 is .* above the bound max-update-norm = 10000", r2[1]), r2
    assert reps["2"]["bytes_up"] > int(cfg["oversize-bytes"])  # the padded reply really crossed the wire
    # round 3: partition 1's node claims partition 0, which the honest node serves: neither is trusted
    (quarantine,) = reps["3"]["quarantined"]
    assert quarantine["partition"] == 0 and len(set(quarantine["nodes"])) == 2
    honest_or_impostor = [str(n) for n in quarantine["nodes"]]
    assert report["node-of-partition"] == {"2": report["node-of-partition"]["2"]}  # partition 0: nobody's
    assert report["node-of-partition"]["2"] not in honest_or_impostor
    r3 = reasons("3", "train")
    assert len(r3) == 2 and all(r.startswith(f"partition 0 is quarantined: nodes {quarantine['nodes']}")
                                for r in r3), r3
    assert rejected_clients("3", "train") == {"partition 0"}  # neither recorded as the partition's values
    for rnd, fit, evaluated in (("1", "partition 0", ["partition 0", "partition 2"]),
                                ("2", "partition 0", ["partition 0", "partition 2"]),
                                ("3", "partition 2", ["partition 2"])):
        assert reps[rnd]["failures"] == []
        assert reps[rnd]["accepted"] == 1
        assert sorted(reps[rnd]["fit_clients"]) == [fit]
        train = report["train"][rnd]
        assert (train["accepted"], train["rejected"], train["failures"]) == (1, 2, 0)
        assert np.isfinite(report["evaluate"][rnd]["loss"])
        # evaluate: partition 1's NaN loss (it names no partition) is dropped, its reply counts; in round 3
        # its node is the impostor, so it and the honest node, both quarantined, are not asked at all
        clients = sorted(reps[rnd]["evaluate_clients"])
        dropped = [(d["key"], d["client"]) for d in reps[rnd]["dropped_metrics"]]
        assert reasons(rnd, "evaluate") == [], reps[rnd]
        if rnd != "3":
            assert clients[1:] == evaluated and clients[0].startswith("node "), clients
            assert dropped == [("loss", clients[0])], (dropped, reps[rnd])
        else:
            assert clients == evaluated and dropped == [], (clients, dropped)

    # the honest client alone was aggregated in rounds 1-2, partition 2 alone in round 3
    model = _load("hostile_project", "model")
    state = model.initial_state(int(cfg["num-features"]))
    for pid in (0, 0, 2):
        x, y = model.partition(int(cfg["data-seed"]), pid, 0, int(cfg["num-features"]))
        state = model.local_train(state, x, y, int(cfg["local-steps"]), float(cfg["lr"]))
    assert set(report["arrays"]) == set(state)
    for key, want_state in state.items():
        np.testing.assert_allclose(_array(report["arrays"][key]), want_state, atol=1e-6)

    log = ANSI.sub("", outcome.log)
    for rnd, stage in [(str(r), st) for r in range(1, HOSTILE_ROUNDS + 1) for st in ("train", "evaluate")]:
        for reason in reasons(rnd, stage):
            assert f"round {rnd} {stage}: rejected reply from" in log and reason in log, reason
    assert f"round 3: partition 0 is claimed by nodes {quarantine['nodes']}: quarantined" in log
    assert "round 1 evaluate: dropped metric 'loss' = nan from node " in log


@pytest.mark.e2e
@pytest.mark.e2e
def test_hostile_rejections_are_logged_as_warnings(hostile_run):
    outcome, _report, _ = hostile_run
    log = ANSI.sub("", outcome.log)
    assert re.search(r"WARNING.*round 1 train: rejected reply from", log), log[-3000:]


@pytest.mark.e2e
def test_a_run_in_which_every_reply_is_bad_ends_failed_with_the_reason(tmp_path):
    outcome, report, _ = launch("hostile_project", tmp_path, scenario="all-bad")
    assert outcome.status == "finished:failed", outcome.log[-4000:]
    assert not outcome.completed and outcome.verdict == "failed"
    assert outcome.leftover == []
    assert report is None  # the ServerApp never got past strategy.start
    reason = f"round 1 trained nobody ({NODES} sampled, {NODES} rejected, 0 failed)"
    assert outcome.failure_reason and reason in outcome.failure_reason, outcome.failure_reason
    assert "'w': dtype float64 != expected float32" in outcome.failure_reason
    log = ANSI.sub("", outcome.log)
    assert f"NoTrainingError: {reason}" in log, log[-4000:]
    assert log.count("dtype float64 != expected float32") >= NODES


# --- legacy API: server_fn + ServerAppComponents + NumPyClient on pollen.strategies.legacy -------------------

@pytest.mark.e2e
def test_legacy_project_runs_on_the_legacy_prototype_strategy(tmp_path):
    outcome, report, _ = launch("legacy_project", tmp_path)
    assert outcome.status == "finished:completed" and outcome.completed, outcome.log[-4000:]
    assert report is not None, outcome.log[-4000:]
    cfg = _app_config("legacy_project")
    expected, _counts, _means, _held = _pooled_prototypes(_load("legacy_project", "task"), cfg)
    assert sorted(report["fit"]) == ["1", "2"] and sorted(report["evaluate"]) == ["1", "2"]
    for rnd in ("1", "2"):
        fit = report["fit"][rnd]
        assert (fit["results"], fit["failures"]) == (NODES, 0)
        assert (fit["metrics"]["accepted"], fit["metrics"]["rejected"]) == (NODES, 0)
        protos, present, margin = (_array(a) for a in fit["arrays"])  # legacy positional payload
        assert (protos.dtype, present.dtype, margin.dtype) == (np.float32, np.int64, np.float32)
        np.testing.assert_allclose(protos, expected, atol=2e-6)
        assert present.tolist() == [1] * int(cfg["num-classes"])
        assert float(margin[0]) == pytest.approx(_median_pair_mse(expected), rel=1e-5)
        ev = report["evaluate"][rnd]
        assert (ev["results"], ev["failures"]) == (NODES, 0) and ev["metrics"]["accuracy"] > 0.9
    assert report["fit"]["1"]["metrics"]["had-global"] == 0 and report["fit"]["2"]["metrics"]["had-global"] == 1
