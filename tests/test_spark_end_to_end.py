"""
End to end: a real `twistd --logfile=... dallal` broker, real clients (the
`dallal` command and a raw socket), then the report over its log.  The
counts in summary.json must equal what the test did.

L{BrokerScenario} counts what each step should log: each subscriber says
how the stories of the messages it is sent end (acked, dropped, ...).  A new
kind of client (say, a slow `latest` subscriber whose messages are
replaced) is a new method that registers its topics with the outcome it
expects, and a new step in L{brokerRun}.
"""

import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

pytest_plugins = ["conftest_spark"]
# Starting the JVM and its first queries take long on a busy machine.
pytestmark = pytest.mark.timeout(300)

PING_INTERVAL = 0.3
STEP_TIMEOUT = 20
PUBLISHED = "your message published successfully"


def script(name):
    """
    A console script of this interpreter's installation (not a shim).
    """
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"the {name} command is not installed")
    return found


class Lines:
    """
    The lines a subprocess prints, read by a thread so that waiting for one
    can time out.
    """

    def __init__(self, stream):
        self._lines = queue.Queue()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream):
        for line in stream:
            self._lines.put(line)

    def next(self, seconds=STEP_TIMEOUT):
        """
        The next line, or None if none came within C{seconds}.
        """
        try:
            return self._lines.get(timeout=seconds)
        except queue.Empty:
            return None


class BrokerScenario:
    """
    A broker under test and what its log must show of the steps taken.

    @ivar expected: summary.json's totals that the steps determine.
    @ivar topics: per topic, C{{"publishes": n, "deliveries": n}}.
    @ivar subscribers: per topic, a L{Counter} of the subscribed sessions
        by how the stories of their messages end (C{"acked"}, ...).
    """

    def __init__(self, folder):
        self.folder = Path(folder)
        self.log = self.folder / "twistd.log"
        self.expected = Counter()
        self.topics = {}
        self.subscribers = {}
        self.connected = 0
        self.processes = []
        self.silentClients = []
        self.broker = None
        self.port = None

    # The broker

    def start(self):
        self.broker = subprocess.Popen(
            [script("twistd"), f"--logfile={self.log}", "-n", "--pidfile=", "dallal",
             "--tcp", "tcp:0:interface=127.0.0.1", "--ping-interval", str(PING_INTERVAL),
             "--message-events"],
            cwd=self.folder,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + STEP_TIMEOUT
        while self.port is None and time.monotonic() < deadline:
            text = self.log.read_text() if self.log.exists() else ""
            match = re.search(r"event=listening transport=tcp address=127\.0\.0\.1:(\d+)", text)
            if match:
                self.port = int(match.group(1))
            elif self.broker.poll() is not None:
                break
            else:
                time.sleep(0.1)
        assert self.port, f"the broker did not start listening: {text[-2000:]}"

    def stop(self):
        """
        Stop the subscribers, then the broker, as an operator would.
        """
        for process in self.processes:
            process.send_signal(signal.SIGTERM)
        for process in self.processes:
            assert process.wait(STEP_TIMEOUT) == 0
        self.processes = []
        self.broker.send_signal(signal.SIGTERM)
        self.broker.wait(STEP_TIMEOUT)

    def kill(self):
        for process in [*self.processes, self.broker]:
            if process is not None and process.poll() is None:
                process.kill()
                process.wait(STEP_TIMEOUT)
        for client in self.silentClients:
            client.close()

    # Bookkeeping

    def _session(self):
        self.expected["sessions"] += 1
        self.connected += 1
        self.expected["peak_connections"] = max(self.expected["peak_connections"], self.connected)

    def _subscribed(self, topic, outcome, change=1):
        self.subscribers.setdefault(topic, Counter())[outcome] += change

    def _published(self, topic):
        outcomes = self.subscribers.get(topic, Counter())
        receivers = sum(outcomes.values())
        counts = self.topics.setdefault(topic, {"publishes": 0, "deliveries": 0})
        counts["publishes"] += 1
        counts["deliveries"] += receivers
        self.expected["publishes"] += 1
        self.expected["deliveries"] += receivers
        self.expected["matched"] += receivers
        self.expected.update(outcomes)

    def _command(self, *arguments):
        return [script("dallal"), "127.0.0.1", str(self.port), *arguments]

    # Clients

    def subscribe(self, *topics):
        """
        Start `dallal subscribe` (mode `latest`) and wait until it is
        subscribed.  It acks each message; publishes are far enough apart
        that none waits long enough to be replaced.
        """
        process = subprocess.Popen(
            self._command("subscribe", *topics), stdout=subprocess.PIPE, text=True
        )
        self.processes.append(process)
        output = Lines(process.stdout)
        assert output.next() == f"subscribing on {' '.join(topics)}\n"
        self._session()
        for topic in topics:
            self._subscribed(topic, "acked")
        return output

    def publish(self, topic, message):
        """
        `dallal publish`: one session that publishes once and leaves.
        """
        result = subprocess.run(
            self._command("publish", topic, message),
            capture_output=True, text=True, timeout=STEP_TIMEOUT,
        )
        assert result.stdout == f"{PUBLISHED}\n", result.stderr
        self._session()
        self.connected -= 1
        self._published(topic)

    def silentSubscriber(self, topic, messages, badTopic):
        """
        A raw socket that subscribes to C{topic} in mode C{all}, publishes
        C{messages} there itself, has a publish refused for C{badTopic}, and
        never acks nor answers the broker's pings: the broker drops it after
        three intervals, with the messages it was sent.

        @return: its address as the broker logs it.
        """
        client = socket.create_connection(("127.0.0.1", self.port), timeout=STEP_TIMEOUT)
        self.silentClients.append(client)
        self._session()
        client.sendall(f"SUB 1 {topic} mode=all\r\n".encode())
        for index, message in enumerate(messages, 2):
            client.sendall(f"PUB {index} {topic} {len(message)}\r\n{message}\r\n".encode())
        client.sendall(f"PUB 0 {badTopic} 2\r\nhi\r\n".encode())
        self._subscribed(topic, "dropped")
        for _ in messages:
            self._published(topic)
        self.expected["dropped_disconnected"] += len(messages)
        self.expected["errors"] += 1
        self.expected["clients_dropped"] += 1
        # Read (and never answer) until the broker hangs up.
        deadline = time.monotonic() + STEP_TIMEOUT
        received = b""
        while time.monotonic() < deadline:
            try:
                data = client.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            received += data
        else:
            pytest.fail(f"the broker did not drop the silent client: {received!r}")
        self.connected -= 1
        self._subscribed(topic, "dropped", -1)
        assert b"SUBACK 1" in received and b"ERR 0 BAD_TOPIC" in received
        host, port = client.getsockname()
        return f"{host}:{port}"

    def waitForMessages(self, output, count):
        """
        Wait until `dallal subscribe` has printed C{count} messages.
        """
        lines = [output.next() for _ in range(count)]
        assert None not in lines, f"only received {lines}"
        return lines

    def waitForAcks(self):
        """
        Wait until the broker has logged every ack expected, so that
        stopping the subscribers drops none of their messages.
        """
        deadline = time.monotonic() + STEP_TIMEOUT
        while time.monotonic() < deadline:
            acks = self.log.read_text().count("] event=ack ")
            if acks >= self.expected["acked"]:
                return
            time.sleep(0.05)
        pytest.fail(f"{acks} acks logged, {self.expected['acked']} expected")


@pytest.fixture(scope="module")
def brokerRun(tmp_path_factory):
    """
    Run the scenario once: its log, expectations and the silent client.
    """
    scenario = BrokerScenario(tmp_path_factory.mktemp("broker"))
    try:
        scenario.start()
        sports = scenario.subscribe("news", "sport")
        news = scenario.subscribe("news")
        silent = scenario.silentSubscriber("ghost", ["boo", "hoo"], badTopic="+bad")
        for topic, message in [("news", "hello world"), ("news", "again"), ("sport", "goal"),
                               ("weather", "nobody listens")]:
            scenario.publish(topic, message)
        scenario.waitForMessages(sports, 3)
        scenario.waitForMessages(news, 2)
        scenario.waitForAcks()
        scenario.stop()
    finally:
        scenario.kill()
    return scenario, silent


@pytest.fixture(scope="module")
def brokerReport(spark, brokerRun, tmp_path_factory):
    import report

    scenario, _ = brokerRun
    out = tmp_path_factory.mktemp("report")
    return out, report.runReport(spark, [str(scenario.log)], out)


def test_real_broker_lines_all_parse(spark, brokerRun):
    from dallal_analytics import parse

    scenario, _ = brokerRun
    text = scenario.log.read_text().splitlines()
    rows = parse.parseLines(parse.readLines(spark, [str(scenario.log)])).collect()
    kinds = Counter(row.kind for row in rows)
    assert kinds[parse.UNPARSED] == 0
    assert kinds[parse.EVENT] == sum(1 for line in text if re.search(r"\[dallal#\w+\] event=", line))
    assert kinds[parse.EVENT] + kinds[parse.OTHER] + kinds[parse.CONTINUATION] == len(text)
    # twistd's own lines (starting up, shutting down) are there and are not events.
    assert kinds[parse.OTHER] >= 2
    assert all(row.t is not None for row in rows if row.kind == parse.EVENT)


def test_summary_counts_what_the_clients_did(brokerRun, brokerReport):
    scenario, _ = brokerRun
    _, summary = brokerReport
    expected = scenario.expected
    for key in ("publishes", "deliveries", "sessions", "peak_connections", "errors",
                "clients_dropped", "matched"):
        assert summary[key] == expected[key], key
    assert {topic: {name: values[name] for name in ("publishes", "deliveries")}
            for topic, values in summary["topics"].items()} == scenario.topics
    assert summary["errors_by_code"] == {"BAD_TOPIC": 1}
    assert summary["unparsed_lines"] == 0
    assert summary["runs"] == 1
    assert summary["counter_mismatches"] == []


def test_every_story_ended_as_expected(brokerRun, brokerReport):
    scenario, _ = brokerRun
    _, summary = brokerReport
    expected = scenario.expected
    for outcome in ("acked", "fired", "replaced", "dropped"):
        assert summary[outcome] == expected[outcome], outcome
    assert {reason: count for reason, count in summary["dropped_by_reason"].items() if count} == {
        name.removeprefix("dropped_"): count
        for name, count in expected.items() if name.startswith("dropped_")
    }
    # The broker stopped after its clients: nothing can still be in flight.
    assert summary["inflight"] == 0


def test_silent_client_session(spark, brokerRun, brokerReport):
    _, silent = brokerRun
    out, _ = brokerReport
    sessions = spark.read.parquet(str(out / "tables" / "sessions"))
    row, = sessions.where(sessions.client == silent).collect()
    assert row.end_reason == "missed_pings"
    assert row.dropped_for_pings is True
    assert row.pings_missed == 2
    assert row.errors == 1
    assert row.publishes == 2
