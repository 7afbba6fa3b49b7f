"""
The rule that separates unit tests from end-to-end ones, as a pytest
plugin (tests/conftest.py loads it).

A test that starts a process (twistd, the C{dallal} command, a JVM for
Spark, pip, git, ruff, a load generator, anything through L{subprocess},
C{os.fork}, C{os.posix_spawn} or C{reactor.spawnProcess}) is end-to-end and
carries the C{e2e} marker: C{pytestmark = pytest.mark.e2e} at the top of a
module whose every test does, C{@pytest.mark.e2e} on the test otherwise.
Every other test is a unit test, and may not start one: while an unmarked
test (its fixtures included) runs, the functions that start processes
raise L{ProcessInUnitTest}, and the test fails even if the code under test
catches that. So C{pytest -m "not e2e"} runs only in-memory tests, fast,
and a new test module that forgets its marker fails on its first process.

To mark a new module: run C{pytest -m "not e2e" tests/test_new.py}; each
test that starts a process fails and names itself. If they are all of the
module's tests, mark the module, otherwise mark each of them.
tests/test_suite_shape.py checks this plugin.
"""

import _posixsubprocess
import os
import subprocess

import pytest


class ProcessInUnitTest(Exception):
    """
    A test without the C{e2e} marker tried to start a process.
    """


# Every way a test can start a process ends in one of these: subprocess
# (and os.popen) in Popen._execute_child, multiprocessing in os.fork or
# _posixsubprocess.fork_exec, Twisted's spawnProcess in os.posix_spawnp or
# os.fork, os.spawn* in os.fork.
_PROCESS_STARTERS = [
    (subprocess.Popen, "_execute_child"),
    (_posixsubprocess, "fork_exec"),
    (os, "fork"),
    (os, "forkpty"),
    (os, "posix_spawn"),
    (os, "posix_spawnp"),
    (os, "system"),
]

_startedProcesses = pytest.StashKey[list]()


def _refuseProcesses(item):
    """
    Make every process starter raise L{ProcessInUnitTest} and note the
    attempt on C{item}, until the returned function is called.
    """
    attempts = item.stash.setdefault(_startedProcesses, [])
    saved = []
    for owner, name in _PROCESS_STARTERS:
        if not hasattr(owner, name):
            continue

        def refuse(*args, _name=name, **kwargs):
            attempts.append(_name)
            raise ProcessInUnitTest(
                f"{item.nodeid} started a process ({_name}) but is not marked e2e: "
                "add pytestmark = pytest.mark.e2e to its module, or @pytest.mark.e2e "
                "to the test (tests/conftest.py)"
            )

        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, refuse)

    def restore():
        for owner, name, original in saved:
            setattr(owner, name, original)

    return restore


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _unlessEndToEnd(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _unlessEndToEnd(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from _unlessEndToEnd(item))


def _unlessEndToEnd(item):
    """
    Run one phase of a test, refusing processes unless it is marked e2e.
    """
    if item.get_closest_marker("e2e") is not None:
        return (yield)
    restore = _refuseProcesses(item)
    try:
        return (yield)
    finally:
        restore()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    attempts = item.stash.get(_startedProcesses, [])
    if attempts and report.passed:
        # The code under test caught ProcessInUnitTest: fail anyway.
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} tried to start a process ({', '.join(attempts)}) "
            "but is not marked e2e (tests/conftest.py)"
        )
    attempts.clear()
    return report


def forgetAttempts(item):
    """
    Forget the processes C{item} tried to start, for a test that tries on
    purpose to check this plugin.
    """
    item.stash.get(_startedProcesses, []).clear()
