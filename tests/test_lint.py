"""The package passes the linter configured in pyproject.toml (pyflakes, pycodestyle, isort, pyupgrade,
bugbear): unused imports, undefined names and shadowed loop variables are caught here, not by users."""

import subprocess
import sys

from tests.conftest import PROJECT_ROOT


def test_ruff_is_clean_on_the_package_and_the_fleet_tool():
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "pollen", "deploy", "--output-format", "concise"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sys.version_info >= (3, 11)
