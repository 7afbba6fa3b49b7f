"""
The code's style is ruff's, configured in pyproject.toml: formatted, and
clean of the lints it selects.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

pytestmark = pytest.mark.e2e

RUFF = Path(sys.executable).parent / "ruff"


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff(command):
    result = subprocess.run(
        [RUFF, *command, "."], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
