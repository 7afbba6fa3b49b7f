"""
The suite's fixtures. The rule that tells unit tests from end-to-end ones
(the C{e2e} marker) is enforced by tests/processguard.py, loaded here.
"""

import os
import tempfile
from pathlib import Path

import pytest
from helpers import BrokerHarness, BrokerProcess

pytest_plugins = ["processguard"]


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
