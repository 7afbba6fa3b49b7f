"""
The suite's shape: unit tests start no process, end-to-end tests carry the
C{e2e} marker (tests/processguard.py), so that C{pytest -m "not e2e"} runs
the unit tests alone.
"""

import os
import subprocess
import sys
import tomllib

import pytest
from helpers import REPO
from processguard import ProcessInUnitTest, forgetAttempts
from twisted.internet import reactor
from twisted.internet.protocol import ProcessProtocol

pytest_plugins = ["pytester"]


def test_markerIsRegistered():
    """
    C{e2e} is declared in pyproject.toml, so that C{-m "not e2e"} and
    C{--strict-markers} know it.
    """
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert any(marker.startswith("e2e:") for marker in options["markers"])


def fork():
    """
    C{os.fork}, with a child that exits at once if the fork is not refused.
    """
    if os.fork() == 0:
        os._exit(0)


@pytest.mark.parametrize(
    "start",
    [
        lambda: subprocess.run([sys.executable, "-c", "pass"]),
        lambda: os.system("true"),
        lambda: os.popen("true"),
        fork,
        lambda: reactor.spawnProcess(
            ProcessProtocol(), sys.executable, [sys.executable, "-c", "pass"]
        ),
    ],
    ids=["subprocess", "os.system", "os.popen", "os.fork", "spawnProcess"],
)
def test_unmarkedTestCannotStartAProcess(request, start):
    """
    In a test without the marker, each way of starting a process raises
    L{ProcessInUnitTest}, naming the test and the marker to add.
    """
    with pytest.raises(ProcessInUnitTest, match="not marked e2e") as raised:
        start()
    assert request.node.nodeid in str(raised.value)
    # This test meant to try: it must not fail for having tried.
    forgetAttempts(request.node)


@pytest.mark.e2e
def test_markedTestsRunAndUnmarkedOnesFailEvenIfTheyCatchTheError(pytester, monkeypatch):
    """
    Run in a pytest of its own: a marked test starts its process; an
    unmarked one fails though the code it runs catches the error, and the
    report says which test and what to do.
    """
    pytester.makeini("[pytest]\nmarkers =\n    e2e: starts a process\n")
    pytester.makepyfile(
        test_shape="""
        import subprocess, sys
        import pytest

        @pytest.mark.e2e
        def test_marked():
            subprocess.run([sys.executable, "-c", "pass"], check=True)

        def test_unmarkedCatching():
            try:
                subprocess.run([sys.executable, "-c", "pass"])
            except Exception:
                pass

        def test_inMemory():
            assert sorted([2, 1]) == [1, 2]
        """
    )
    monkeypatch.setenv("PYTHONPATH", str(REPO / "tests"))
    result = pytester.runpytest_subprocess(
        "-p",
        "processguard",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(pytester.path),
        timeout=60,
    )
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*test_unmarkedCatching*not marked e2e*"])


# The test modules that span several modules, by what each covers.
SPANNING = {
    "architecture": "the import contracts (pyproject.toml)",
    "bench_compare": "the pure logic of bench/compare.py",
    "bounds": "what one client may make the broker hold, across transports",
    "events_catalogue": "docs/EVENTS.md against the events the broker emits",
    "flow_control": "publishers held back by full queues, through the TCP protocol",
    "parser_properties": "property tests of every parser of network bytes",
    "reload": "SIGHUP: files read again by a running broker",
    "shutdown": "a broker that stops, through its service",
    "soak_short": "bench/soak.py, short",
    "style": "ruff",
    "suite_shape": "this module",
    "tls": "TLS listeners, the command and the client",
    "topic_requests": "filters, retained messages, LIST, TOPICS and to-matching publishes",
}


def test_eachTestModuleNamesWhatItTests():
    """
    A test module is named after the module it tests (C{test_<module>}, or
    C{test_<package>_<module>} where the name alone is ambiguous), or is an
    end-to-end suite (C{test_e2e_*}), an analytics suite (C{test_spark_*}),
    or one of L{SPANNING}: a reader finds a module's tests by its name.
    """
    modules = set()
    for path in (REPO / "dallal").rglob("*.py"):
        if not path.stem.startswith("__"):
            parts = path.relative_to(REPO / "dallal").with_suffix("").parts
            modules.update({parts[-1], "_".join(parts)})
    misnamed = [
        path.name
        for path in sorted((REPO / "tests").glob("test_*.py"))
        if not path.stem.startswith(("test_e2e_", "test_spark_"))
        and path.stem.removeprefix("test_") not in modules | SPANNING.keys()
    ]
    assert misnamed == []
    assert all((REPO / "tests" / f"test_{name}.py").exists() for name in SPANNING)
