"""
The layers of the code (README.md, "Layout"): the import contracts in
pyproject.toml hold, checked by import-linter, and cover every module.
"""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import REPO

from dallal.broker.core import Broker

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


# What of a Broker's own state its transports may read besides its
# methods: the parts it composes (its session table, router, directory,
# ledger, flow control, limit log, ...) are the core's alone.
FACADE_STATE = {"clock", "config", "events", "counters", "shuttingDown", "started"}


def syntaxTrees(package):
    """
    The parsed modules of a package of the source tree, by path.
    """
    return {
        path: ast.parse(path.read_text())
        for path in sorted((REPO / package.replace(".", "/")).glob("*.py"))
    }


def isPrivate(name):
    return name.startswith("_") and not name.startswith("__")


def privateNames(tree):
    """
    The private methods and instance attributes a module defines.
    """
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and isPrivate(node.name):
            names.add(node.name)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
            and isPrivate(node.attr)
        ):
            names.add(node.attr)
    return names


def reachesIntoTheBroker(tree, brokerPrivates):
    """
    Where a module reads a private attribute of a broker object, or what
    of a Broker is neither a method nor L{FACADE_STATE}.

    @return: C{(line, expression)} pairs.
    """
    facade = {name for name in vars(Broker) if not isPrivate(name)} | FACADE_STATE
    ownPrivates = privateNames(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        ownerName = (
            owner.id
            if isinstance(owner, ast.Name)
            else owner.attr
            if isinstance(owner, ast.Attribute)
            else None
        )
        if ownerName == "broker" and node.attr not in facade:
            found.append((node.lineno, ast.unparse(node)))
        elif (
            ownerName not in ("self", "cls")
            and node.attr in brokerPrivates
            and node.attr not in ownPrivates
        ):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_serversUseTheBrokersFacade():
    """
    The transports reach the core through L{Broker}'s methods: no module
    of C{dallal/server/} reads a private attribute of a broker object, nor
    a part of the broker behind its facade (a session's outbox, the
    router, the directory, ...).
    """
    brokerPrivates = set().union(*map(privateNames, syntaxTrees("dallal.broker").values()))
    found = {
        path.name: reaching
        for path, tree in syntaxTrees("dallal.server").items()
        if (reaching := reachesIntoTheBroker(tree, brokerPrivates))
    }
    assert found == {}


def test_reachingIntoTheBrokerIsFound():
    """
    The check above finds a window set on a session's outbox, and a
    private attribute of the core read by another name.
    """
    tree = ast.parse(
        "outbox = self.broker.sessions[self].outbox\n"
        "outbox.config = outbox.config.replace(maxInflight=window)\n"
        "used = outbox._windowUsed\n"
    )
    assert reachesIntoTheBroker(tree, {"_windowUsed"}) == [
        (1, "self.broker.sessions"),
        (3, "outbox._windowUsed"),
    ]
