"""
End to end: what C{twistd -n dallal} (and the README's C{.tac}) tells the
operator when it cannot start, on the terminal and in its log.
"""

import io
import socket
import subprocess

import pytest
from helpers import COMMAND_TIMEOUT, TWISTD
from test_e2e_tac import readmeTac
from twisted.logger import Logger, LogPublisher

from dallal.server.tap import reportStartFailures

pytestmark = pytest.mark.e2e


@pytest.fixture
def busyPort():
    """
    A loopback port number taken, for TCP and for UDP, by this process.
    """
    with socket.socket() as stream, socket.socket(type=socket.SOCK_DGRAM) as datagram:
        stream.bind(("127.0.0.1", 0))
        stream.listen()
        port = stream.getsockname()[1]
        datagram.bind(("127.0.0.1", port))
        yield port


def twistd(cwd, *arguments):
    return subprocess.run(
        [str(TWISTD), "-n", "--pidfile=", *map(str, arguments)],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )


def failureLines(output, sentence):
    """
    The lines of C{output} that say C{sentence}, and that it has no
    traceback.
    """
    assert b"Traceback" not in output, output.decode()
    return [line for line in output.splitlines() if sentence in line]


@pytest.mark.parametrize(
    "options, where",
    [
        (["--tcp", "{port}"], "127.0.0.1:{port}"),
        (["--tcp", "tcp:{port}:interface=127.0.0.1"], "127.0.0.1:{port}"),
        (["--tcp", "0", "--udp", "{port}"], "127.0.0.1:{port} (UDP)"),
        (["--tcp", "0", "--http", "{port}"], "127.0.0.1:{port} (HTTP)"),
    ],
)
def test_portInUse(tmp_path, busyPort, options, where):
    """
    A port already taken stops twistd with one line saying which and why,
    in its log (on standard output with C{-n}), and exit status 1.
    """
    options = [option.format(port=busyPort) for option in options]
    result = twistd(tmp_path, "dallal", *options)
    sentence = f"cannot listen on {where.format(port=busyPort)}: address already in use"
    assert len(failureLines(result.stdout, sentence.encode())) == 1, result.stdout.decode()
    assert (result.stderr, result.returncode) == (b"", 1)


def test_portInUseWithLogFile(tmp_path, busyPort):
    """
    With C{--logfile}, the reason is in the log file and on the terminal.
    """
    result = twistd(tmp_path, "--logfile", "broker.log", "dallal", "--tcp", busyPort)
    sentence = f"cannot listen on 127.0.0.1:{busyPort}: address already in use"
    assert (result.stdout, result.stderr, result.returncode) == (
        b"",
        sentence.encode() + b"\n",
        1,
    )
    log = (tmp_path / "broker.log").read_bytes()
    assert len(failureLines(log, sentence.encode())) == 1, log.decode()


def test_portInUseByADaemon(tmp_path, busyPort):
    """
    Without C{-n}, twistd's waiting parent says why, and the pid file is
    gone.
    """
    result = subprocess.run(
        [TWISTD, "--pidfile=twistd.pid", "--logfile=broker.log", "dallal", "--tcp", str(busyPort)],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )
    sentence = f"cannot listen on 127.0.0.1:{busyPort}: address already in use"
    assert result.returncode == 1
    assert sentence.encode() in result.stderr, result.stderr
    assert not (tmp_path / "twistd.pid").exists()


def test_portInUseByTheReadmeTac(tmp_path, busyPort):
    (tmp_path / "dallal.tac").write_text(readmeTac().replace("tcp:0:", f"tcp:{busyPort}:"))
    result = twistd(tmp_path, "-y", "dallal.tac")
    sentence = f"cannot listen on 127.0.0.1:{busyPort}: address already in use"
    assert len(failureLines(result.stdout, sentence.encode())) == 1, result.stdout.decode()
    assert (result.stderr, result.returncode) == (b"", 1)


def test_logFileInAMissingFolder(tmp_path):
    """
    One line, and nothing made: no data directory, no log.
    """
    result = twistd(tmp_path, "--logfile", "logs/broker.log", "dallal", "--tcp", "0")
    assert (result.stdout, result.stderr, result.returncode) == (
        b"",
        f"dallal: cannot start: --logfile logs/broker.log: there is no folder "
        f"{tmp_path / 'logs'}\n".encode(),
        1,
    )
    assert list(tmp_path.iterdir()) == []


class _NotYetRunning:
    """
    A reactor that has not run yet: what it is to call once it runs.
    """

    def __init__(self):
        self.whenRunning = []

    def callWhenRunning(self, function, *arguments):
        self.whenRunning.append((function, arguments))

    def run(self):
        for function, arguments in self.whenRunning:
            function(*arguments)


def test_startFailuresGoToTheTerminalUntilTheReactorRuns():
    reactor, terminal, publisher = _NotYetRunning(), io.StringIO(), LogPublisher()
    log = Logger(observer=publisher)
    reportStartFailures(reactor, terminal, publisher)
    log.info("starting")
    log.error("cannot listen on {where}", where="127.0.0.1:1373")
    reactor.run()
    log.error("after the start")
    assert terminal.getvalue() == "cannot listen on 127.0.0.1:1373\n"
