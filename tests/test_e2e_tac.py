"""
The README's C{.tac} example, run as the README says, with C{twistd -ny}.
"""

import re

import pytest
from helpers import REPO, TWISTD, BrokerProcess, dallal, subscriber

pytestmark = pytest.mark.e2e

README_PORT = "tcp:1373:"


def readmeTac():
    """
    The C{.tac} file of README.md, listening on an ephemeral port instead of
    1373 so that the test never collides with a broker already running.
    """
    readme = (REPO / "README.md").read_text()
    (tac,) = re.findall(r"```python\n(# dallal\.tac.*?)```", readme, re.DOTALL)
    assert tac.count(README_PORT) == 1, tac
    return tac.replace(README_PORT, "tcp:0:")


def test_readmeTac(tmp_path):
    (tmp_path / "dallal.tac").write_text(readmeTac())
    # --pidfile= after the file name: twistd's options may come in any order.
    broker = BrokerProcess([TWISTD, "-ny", "dallal.tac", "--pidfile="], tmp_path)
    try:
        result = dallal("127.0.0.1", broker.port, "publish", "news", "hello world")
        assert result.stdout == b"your message published successfully\n"
        assert result.returncode == 0
        # twistd removes its pid file when it stops: look while it runs.
        assert not (tmp_path / "twistd.pid").exists()
    finally:
        broker.stop()


def test_readmeTacKeepsRetainedMessages(tmp_path):
    """
    A retained message published to the README's broker is still there
    after a restart.
    """
    (tmp_path / "dallal.tac").write_text(readmeTac())
    argv = [TWISTD, "-ny", "dallal.tac", "--pidfile="]
    broker = BrokerProcess(argv, tmp_path)
    try:
        result = dallal("127.0.0.1", broker.port, "publish", "--retain", "news", "kept")
        assert result.stdout == b"your message published successfully\n"
    finally:
        broker.stop()
    broker = BrokerProcess(argv, tmp_path)
    try:
        listening = subscriber(broker.port, "news")
        try:
            listening.waitFor(rb"news: kept\n")
        finally:
            listening.terminate()
    finally:
        broker.stop()
