"""The wheel ships one top-level package, `pollen`, and the Flower app metadata is valid."""

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from tests.conftest import PROJECT_ROOT


def test_wheel_contains_only_the_pollen_package(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(PROJECT_ROOT)],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("pollen_fl-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"pollen"}
    for sub in ("app", "strategies", "clients", "datasets", "models"):
        assert f"pollen/{sub}/__init__.py" in names
    assert not any("/tests/" in n or n.startswith("tests/") for n in names)


def test_flower_app_metadata():
    meta = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    assert re.fullmatch(r"[A-Za-z][A-Za-z0-9-]{0,31}", meta["project"]["name"])
    comps = meta["tool"]["flwr"]["app"]["components"]
    assert comps == {"serverapp": "pollen.app.server_app:app", "clientapp": "pollen.app.client_app:app"}
    assert any(dep.startswith("flwr[simulation]>=1.42") for dep in meta["project"]["optional-dependencies"]["train"])


def test_no_top_level_shadowing_packages():
    """Flower puts the app directory first on sys.path: top-level names like `datasets` would shadow."""
    tops = {p.name for p in PROJECT_ROOT.iterdir() if (p / "__init__.py").exists()}
    # bench/ is a package too (`python -m bench.x`): no installed distribution provides or imports `bench`
    assert tops == {"pollen", "bench"}
    import importlib.util

    spec = importlib.util.find_spec("bench")
    assert spec is None or Path(spec.origin or "").resolve().parent == PROJECT_ROOT / "bench"
