"""
The layers of the code (README.md, "Code layout"): the import contracts in
pyproject.toml hold, checked by import-linter.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

pytestmark = pytest.mark.e2e

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def test_import_contracts_hold():
    """
    The broker imports no wire protocol or server, wire protocols import no
    broker, the client and the command line import neither broker nor
    server: C{lint-imports} keeps every contract.
    """
    result = subprocess.run(
        [LINT_IMPORTS, "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
