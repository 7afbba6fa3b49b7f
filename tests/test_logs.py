"""
The broker's log rotated as the operator says: C{twistd
--logger=dallal.server.logs.rotatingLog}, set by the environment.
"""

import re
import time

import pytest
from helpers import LOOPBACK_ANY_PORT, START_TIMEOUT, TWISTD, OutputCollector, dallal

from dallal.server.logs import DEFAULT_KEEP, DEFAULT_ROTATE_BYTES, rotatingLogFile

PUBLISHED = b"your message published successfully\n"


def test_defaults(tmp_path):
    log = rotatingLogFile({"DALLAL_LOGFILE": str(tmp_path / "broker.log")})
    assert (log.rotateLength, log.maxRotatedFiles) == (DEFAULT_ROTATE_BYTES, DEFAULT_KEEP)
    assert log.path == str(tmp_path / "broker.log")


def test_rotatesAtTheSizeAndKeepsTheNumberOfFiles(tmp_path):
    log = rotatingLogFile(
        {
            "DALLAL_LOGFILE": str(tmp_path / "broker.log"),
            "DALLAL_LOG_ROTATE_BYTES": "100",
            "DALLAL_LOG_KEEP": "2",
        }
    )
    for number in range(10):
        log.write(f"line {number:02} {'x' * 41}\n")
    log.close()
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "broker.log",
        "broker.log.1",
        "broker.log.2",
    ]
    # 50 bytes a line: a file is rotated once it holds 100.
    assert (tmp_path / "broker.log.2").read_text().startswith("line 04 ")
    assert (tmp_path / "broker.log.1").read_text().startswith("line 06 ")
    assert (tmp_path / "broker.log").read_text().startswith("line 08 ")


@pytest.mark.parametrize(
    "name, value, minimum",
    [
        ("DALLAL_LOG_ROTATE_BYTES", "10MB", 1),
        ("DALLAL_LOG_ROTATE_BYTES", "0", 1),
        ("DALLAL_LOG_KEEP", "-1", 1),
    ],
)
def test_aWrongSettingIsOneLine(tmp_path, name, value, minimum):
    with pytest.raises(SystemExit) as stopped:
        rotatingLogFile({"DALLAL_LOGFILE": str(tmp_path / "broker.log"), name: value})
    assert str(stopped.value) == (
        f"dallal: cannot start: {name} must be a whole number of at least {minimum}, not {value!r}"
    )


def test_aMissingFolderIsOneLine(tmp_path):
    path = tmp_path / "missing" / "broker.log"
    with pytest.raises(SystemExit) as stopped:
        rotatingLogFile({"DALLAL_LOGFILE": str(path)})
    assert str(stopped.value) == (
        f"dallal: cannot start: cannot open the log file {path}: No such file or directory"
    )


def waitForLine(path, pattern, timeout=START_TIMEOUT):
    """
    Wait until the file at C{path} has a line matching C{pattern}.

    @return: the match.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            found = re.search(pattern, path.read_bytes())
            if found:
                return found
        time.sleep(0.1)
    raise AssertionError(f"no {pattern!r} in {path} within {timeout} s")


@pytest.mark.e2e
def test_aBrokerLogsAndRotates(tmp_path):
    log = tmp_path / "broker.log"
    environment = {
        "DALLAL_LOGFILE": str(log),
        "DALLAL_LOG_ROTATE_BYTES": "2000",
        "DALLAL_LOG_KEEP": "2",
    }
    broker = OutputCollector(
        [
            TWISTD,
            "--logger=dallal.server.logs.rotatingLog",
            "-n",
            "--pidfile=",
            "dallal",
            "--tcp",
            LOOPBACK_ANY_PORT,
            "--message-events",
        ],
        tmp_path,
        env=environment,
    )
    try:
        port = waitForLine(log, rb"event=listening transport=tcp address=127\.0\.0\.1:(\d+)")[1]
        # 40 publish events of some 200 bytes each, and their acks.
        published = dallal("127.0.0.1", port.decode(), "publish", "--count", "40", "news", "x")
        assert published.stdout == PUBLISHED, published
    finally:
        assert broker.terminate() in (0, -15)
    assert broker.output == b""
    names = sorted(path.name for path in tmp_path.iterdir() if path.name.startswith("broker"))
    assert names == ["broker.log", "broker.log.1", "broker.log.2"]
    for rotated in ("broker.log.1", "broker.log.2"):
        lines = (tmp_path / rotated).read_bytes().splitlines(keepends=True)
        size = sum(map(len, lines))
        # Rotated once it holds 2000 bytes: its last line took it past them.
        assert size - len(lines[-1]) < 2000 <= size, (rotated, size)
    assert b"event=publish " in (tmp_path / "broker.log.1").read_bytes()
    # The final statistics, logged as it stops, are in the newest files
    # (a line that long may have rotated the log once more).
    newest = log.read_bytes() + (tmp_path / "broker.log.1").read_bytes()
    assert b"event=stats " in newest
