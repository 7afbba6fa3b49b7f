"""
The suite's fixtures. The rule that tells unit tests from end-to-end ones
(the C{e2e} marker) is enforced by tests/processguard.py, loaded here.
"""

import os
import tempfile
from pathlib import Path

import pytest
from helpers import BrokerHarness, BrokerProcess, Subscriber

pytest_plugins = ["processguard"]

# The modules whose tests share a session-scoped fixture (tests/conftest_spark.py)
# and so run on one worker of C{pytest -n}: the dallal-report run on a local
# cluster, and the SparkSession of the other Spark modules.
SPARK_MODULES = "test_spark_"
SITE_REPORT_MODULES = {"test_spark_cluster", "test_spark_session"}


def _workerGroup(module):
    """
    The group of tests one worker runs together: C{"siteReport"},
    C{"spark"} or the test's own module.
    """
    if module in SITE_REPORT_MODULES:
        return "siteReport"
    return "spark" if module.startswith(SPARK_MODULES) else module


def _queueRank(item):
    """
    Where a test's module comes in the queue that the workers of
    C{pytest -n} take from: the longest first (the Spark modules, then those
    with end-to-end tests), so that the quick unit modules fill in at the
    end.
    """
    if item.path.stem.startswith(SPARK_MODULES):
        return 0
    return 1 if item.get_closest_marker("e2e") else 2


def pytest_collection_modifyitems(items):
    rank = {}
    for item in items:
        rank[item.path] = min(rank.get(item.path, 2), _queueRank(item))
    items.sort(key=lambda item: rank[item.path])


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """
    With C{pytest -n}, each worker takes whole modules, in the order above,
    and the modules that share a session-scoped fixture go together
    (L{_workerGroup}): a module's broker, the SparkSession and the report on
    a local cluster each start once, not once per worker.
    """
    from xdist.scheduler import LoadFileScheduling

    class WorkerGroups(LoadFileScheduling):
        def _split_scope(self, nodeid):
            return _workerGroup(Path(LoadFileScheduling._split_scope(self, nodeid)).stem)

    # The queue keeps the order of the collection (not the largest first).
    config.option.loadscopereorder = False
    return WorkerGroups(config, log)


def pytest_configure(config):
    # Hypothesis keeps its example database and caches in .hypothesis/ under
    # the working directory, which is the checkout: keep them out of it.
    os.environ.setdefault(
        "HYPOTHESIS_STORAGE_DIRECTORY", str(Path(tempfile.gettempdir()) / "dallal-hypothesis")
    )


@pytest.fixture
def harness():
    """
    A broker core and its TCP protocol on a fake clock, in memory.
    """
    return BrokerHarness()


@pytest.fixture
def broker(tmp_path):
    """
    A real C{twistd -n dallal} on an ephemeral port, run from C{tmp_path}; it
    must stop on SIGTERM, cleanly and without a traceback in its log.
    """
    process = BrokerProcess.plugin(tmp_path)
    try:
        yield process
    finally:
        process.stop()


@pytest.fixture
def startBroker(tmp_path):
    """
    Start C{twistd -n dallal} with extra options; each is stopped (and
    checked for a clean exit) at the end of the test.
    """
    started = []

    def start(*options):
        process = BrokerProcess.plugin(tmp_path, *map(str, options))
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture
def subscribers(tmp_path):
    """
    Start L{Subscriber}s; any still running at the end is stopped.
    """
    started = []

    def start(port, topic, mode=None):
        errors = tmp_path / f"subscriber-{len(started)}.stderr"
        process = Subscriber(port, topic, errors, mode)
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()
