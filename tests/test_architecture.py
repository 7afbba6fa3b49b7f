"""
The layers of the code (README.md, "Layout"): the import contracts in
pyproject.toml hold, checked by import-linter, and cover every module.
"""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import REPO

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def contracts():
    """
    The import-linter contracts of pyproject.toml, by name.
    """
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return {contract["name"]: contract for contract in config["tool"]["importlinter"]["contracts"]}


def moduleNames(package):
    """
    The modules of a package of the source tree, without C{__init__} and
    C{__main__}.
    """
    return {
        path.stem
        for path in (REPO / package.replace(".", "/")).glob("*.py")
        if not path.stem.startswith("__")
    }


def test_everySharedModuleIsInTheVocabularyContract():
    """
    A module at the top of C{dallal/} is shared vocabulary: the contract
    that it imports no layer names each one, so that a new one cannot
    escape it.
    """
    [vocabulary] = [
        contract
        for name, contract in contracts().items()
        if name.startswith("The shared vocabulary")
    ]
    assert set(vocabulary["source_modules"]) == {f"dallal.{name}" for name in moduleNames("dallal")}


def test_everyPartOfTheBrokerIsInItsLayers():
    """
    Each module of C{dallal/broker/} has its place in the broker's layers.
    """
    [layered] = [contract for contract in contracts().values() if contract["type"] == "layers"]
    placed = {name.strip() for layer in layered["layers"] for name in layer.split("|")}
    assert placed == moduleNames("dallal.broker")


@pytest.mark.e2e
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
