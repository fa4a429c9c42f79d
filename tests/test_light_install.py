"""The light install: ``pip install pollen-fl`` is what ``pollen.strategies``, ``pollen.protocol`` and
``pollen.privacy`` need (flwr + numpy + dp-accounting); the ``train`` extra adds torch, torchvision,
Flower's simulation extra and the app's libraries. The wheel's metadata says so, the strategy packages
import with the ``train`` libraries made unimportable, and (e2e) the wheel installed without extras into
a fresh venv runs an external project's ServerApp and ClientApps (``tests/external/weights_project``,
served by the in-process grid) — with neither torch nor Ray installed."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from tests.conftest import PROJECT_ROOT

BASE = {"flwr", "numpy", "dp-accounting", "cryptography"}
TRAIN_ONLY = ("torch", "torchvision", "ray", "safetensors", "matplotlib", "sklearn", "scipy", "PIL")


def _wheel(tmp_path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(PROJECT_ROOT)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("pollen_fl-*.whl")
    return wheel


def test_the_wheel_requires_only_what_the_strategies_import(tmp_path):
    wheel = _wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requires = re.findall(r"^Requires-Dist: (.+)$", meta, flags=re.M)
    base = {re.split(r"[\s\[<>=;!~]", r, maxsplit=1)[0] for r in requires if "extra ==" not in r}
    train = " ".join(r for r in requires if "extra == 'train'" in r or 'extra == "train"' in r)
    assert base == BASE, requires
    for name in ("flwr[simulation]", "torch", "torchvision"):
        assert name in train, requires


def test_the_strategy_packages_import_without_the_train_libraries():
    """Every library of the ``train`` extra made unimportable: the base packages still import."""
    blocked = ", ".join(repr(m) for m in TRAIN_ONLY)
    code = textwrap.dedent(f"""
        import sys
        for name in ({blocked},):
            sys.modules[name] = None  # import fails
        import pollen.strategies, pollen.protocol, pollen.privacy, pollen.secagg
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


RUN_EXTERNAL = textwrap.dedent("""
    import json, sys, tomllib
    from pathlib import Path
    project, report = Path(sys.argv[1]), Path(sys.argv[2])
    sys.path.insert(0, str(project))
    import pollen.testing as grid_mod  # the in-process grid ships with the light install
    from flwr.app import Context, RecordDict
    from extproj_weights.client_app import app as client_app
    from extproj_weights.server_app import main
    import pollen
    config = tomllib.loads((project / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    config["report-path"] = str(report)
    nodes = {100 + p: grid_mod.clientapp_node(client_app, config, p, 3) for p in range(3)}
    main(grid_mod.InProcessGrid(nodes), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                                                run_config=config))
    print(json.dumps({"pollen": pollen.__file__, "torch": "torch" in sys.modules, "ray": "ray" in sys.modules}))
""")


@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_the_wheel_without_extras_runs_an_external_project_in_a_fresh_venv(tmp_path):
    """Needs the package index (PyPI or the machine's configured mirrors) for flwr and its dependencies."""
    wheel = _wheel(tmp_path / "wheel")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", str(wheel)],
                          capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stderr[-3000:]
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], capture_output=True,
                               text=True, check=True).stdout
    names = {p["name"].lower() for p in json.loads(installed)}
    assert not names & {"torch", "torchvision", "ray"}, sorted(names)
    report = tmp_path / "report.json"
    run = subprocess.run([str(python), "-c", RUN_EXTERNAL, str(PROJECT_ROOT / "tests" / "external" / "weights_project"),
                          str(report)],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["pollen"].startswith(str(venv)) and not seen["torch"] and not seen["ray"], seen
    result = json.loads(report.read_text())
    assert sorted(result["per-round-arrays"]) == ["0", "1", "2"] and result["train"], result.keys()
    size = sum(f.stat().st_size for f in venv.rglob("*") if f.is_file() and not f.is_symlink())
    print(f"light install: {size / 2**20:.0f} MiB venv, {len(names)} distributions")
    shutil.rmtree(venv, ignore_errors=True)
