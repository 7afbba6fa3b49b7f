"""
End to end: a real `twistd --logfile=... dallal` broker, real clients (the
`dallal` command and a raw socket), then the report over its log.  The
counts in summary.json must equal what the test did.

L{BrokerScenario} counts what each step should log: each subscriber says
how the stories of the messages it is sent end (acked, dropped, replaced,
...).  A new kind of client is a new method that registers its topics with
the outcome it expects, and a new step in L{brokerRun}.
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
from helpers import decodeFrames

pytest_plugins = ["conftest_spark"]
# Starting the JVM and its first queries take long on a busy machine.
pytestmark = [pytest.mark.timeout(300), pytest.mark.e2e]

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
            [
                script("twistd"),
                f"--logfile={self.log}",
                "-n",
                "--pidfile=",
                "dallal",
                "--tcp",
                "tcp:0:interface=127.0.0.1",
                "--ping-interval",
                str(PING_INTERVAL),
                "--message-events",
            ],
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
        # A replaced message was never sent.
        sent = receivers - outcomes["replaced"]
        counts = self.topics.setdefault(topic, {"publishes": 0, "deliveries": 0})
        counts["publishes"] += 1
        counts["deliveries"] += sent
        self.expected["publishes"] += 1
        self.expected["deliveries"] += sent
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
            capture_output=True,
            text=True,
            timeout=STEP_TIMEOUT,
        )
        assert result.stdout == f"{PUBLISHED}\n", result.stderr
        self._session()
        self.connected -= 1
        self._published(topic)

    def _rawClient(self):
        client = socket.create_connection(("127.0.0.1", self.port), timeout=STEP_TIMEOUT)
        self.silentClients.append(client)
        self._session()
        return client

    def _readFrames(self, client, received, enough, answerPings=False):
        """
        Read what the broker sends C{client} after the C{received} bytes
        until its frames are C{enough} or it hangs up.

        @return: the bytes received, and whether the broker hung up.
        """
        deadline = time.monotonic() + STEP_TIMEOUT
        pings = 0
        while time.monotonic() < deadline:
            try:
                data = client.recv(65536)
            except ConnectionResetError:
                return received, True
            if not data:
                return received, True
            received += data
            try:
                frames = decodeFrames(received)
            except (ValueError, AssertionError):
                # The last frame is not all there yet.
                continue
            newPings = sum(1 for frame in frames if frame.verb == b"PING")
            if answerPings and newPings > pings:
                client.sendall(b"PONG\r\n" * (newPings - pings))
                pings = newPings
            if enough(frames):
                return received, False
        pytest.fail(f"the broker did not send what was expected: {received!r}")

    def _clientAddress(self, client):
        host, port = client.getsockname()
        return f"{host}:{port}"

    def silentSubscriber(self, topic, messages, badTopic):
        """
        A raw socket that subscribes to C{topic} in mode C{all}, publishes
        C{messages} there itself, has a publish refused for C{badTopic}, and
        never acks nor answers the broker's pings: the broker drops it after
        three intervals, with the messages it was sent.

        @return: its address as the broker logs it.
        """
        client = self._rawClient()
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
        received, _ = self._readFrames(client, b"", lambda frames: False)
        self.connected -= 1
        self._subscribed(topic, "dropped", -1)
        assert b"SUBACK 1" in received and b"ERR 0 BAD_TOPIC" in received
        return self._clientAddress(client)

    def slowLatestSubscriber(self, topic, messages):
        """
        A raw socket that subscribes to C{topic} in mode C{latest} and,
        before reading anything, publishes C{messages} there itself: the
        broker sends it the first; the second waits for its ack, and each
        later one replaces the one waiting.  Only then does it ack the first,
        and the last, which the broker sends next; then it says BYE.

        @return: its address as the broker logs it, and the MSG frames it
            received.
        """
        client = self._rawClient()
        client.sendall(
            f"SUB 1 {topic} mode=latest\r\n".encode()
            + b"".join(
                f"PUB {index} {topic} {len(message)}\r\n{message}\r\n".encode()
                for index, message in enumerate(messages, 2)
            )
        )
        last = len(messages) - 1
        for index in range(len(messages)):
            outcome = "replaced" if 0 < index < last else "acked"
            self._subscribed(topic, outcome)
            self._published(topic)
            self._subscribed(topic, outcome, -1)

        def sent(count):
            return lambda frames: sum(frame.verb == b"MSG" for frame in frames) >= count

        received = b""
        for count in (1, 2):
            received, hungUp = self._readFrames(client, received, sent(count), answerPings=True)
            assert not hungUp, received
            delivery = [frame for frame in decodeFrames(received) if frame.verb == b"MSG"][-1]
            options = dict(option.split(b"=") for option in delivery.arguments[2:])
            client.sendall(b"ACK " + options[b"id"] + b"\r\n")
        client.sendall(b"BYE\r\n")
        received, hungUp = self._readFrames(
            client, received, lambda frames: False, answerPings=True
        )
        address = self._clientAddress(client)
        self._waitForLogged(
            f"event=disconnect session=\\d+ client={re.escape(address)} ",
            f"the disconnect of {address}",
        )
        self.connected -= 1
        return address, [frame for frame in decodeFrames(received) if frame.verb == b"MSG"]

    def waitForMessages(self, output, count):
        """
        Wait until `dallal subscribe` has printed C{count} messages.
        """
        lines = [output.next() for _ in range(count)]
        assert None not in lines, f"only received {lines}"
        return lines

    def _waitForLogged(self, pattern, what, count=1):
        """
        Wait until the broker has logged C{count} lines matching C{pattern}.
        """
        deadline = time.monotonic() + STEP_TIMEOUT
        while time.monotonic() < deadline:
            found = len(re.findall(pattern, self.log.read_text()))
            if found >= count:
                return
            time.sleep(0.05)
        pytest.fail(f"{what}: {found} logged, {count} expected")

    def waitForAcks(self):
        """
        Wait until the broker has logged every ack expected, so that
        stopping the subscribers drops none of their messages.
        """
        self._waitForLogged(r"\] event=ack ", "acks", self.expected["acked"])


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
        slow = scenario.slowLatestSubscriber("slow", ["one", "two", "three", "four", "five"])
        for topic, message in [
            ("news", "hello world"),
            ("news", "again"),
            ("sport", "goal"),
            ("weather", "nobody listens"),
        ]:
            scenario.publish(topic, message)
        scenario.waitForMessages(sports, 3)
        scenario.waitForMessages(news, 2)
        scenario.waitForAcks()
        scenario.stop()
    finally:
        scenario.kill()
    return scenario, silent, slow


@pytest.fixture(scope="module")
def brokerReport(spark, brokerRun, tmp_path_factory):
    import report

    scenario, _, _ = brokerRun
    out = tmp_path_factory.mktemp("report")
    return out, report.runReport(spark, [str(scenario.log)], out, deliveries=True)


def test_real_broker_lines_all_parse(spark, brokerRun):
    from dallal_analytics import parse

    scenario, _, _ = brokerRun
    text = scenario.log.read_text().splitlines()
    rows = parse.parseLines(parse.readLines(spark, [str(scenario.log)])).collect()
    kinds = Counter(row.kind for row in rows)
    assert kinds[parse.UNPARSED] == 0
    assert kinds[parse.EVENT] == sum(
        1 for line in text if re.search(r"\[dallal#\w+\] event=", line)
    )
    assert kinds[parse.EVENT] + kinds[parse.OTHER] + kinds[parse.CONTINUATION] == len(text)
    # twistd's own lines (starting up, shutting down) are there and are not events.
    assert kinds[parse.OTHER] >= 2
    assert all(row.t is not None for row in rows if row.kind == parse.EVENT)


def test_summary_counts_what_the_clients_did(brokerRun, brokerReport):
    scenario, _, _ = brokerRun
    _, summary = brokerReport
    expected = scenario.expected
    for key in (
        "publishes",
        "deliveries",
        "matched",
        "acked",
        "replaced",
        "dropped",
        "sessions",
        "peak_connections",
        "errors",
        "clients_dropped",
    ):
        assert summary[key] == expected[key], key
    # The broker's own $SYS/... topics appear if the run outlasted its first
    # --sys-interval: they are not the clients'.
    assert {
        topic: {name: values[name] for name in ("publishes", "deliveries")}
        for topic, values in summary["topics"].items()
        if not topic.startswith("$")
    } == scenario.topics
    assert summary["errors_by_code"] == {"BAD_TOPIC": 1}
    assert summary["unparsed_lines"] == 0
    assert summary["runs"] == 1
    assert summary["counter_mismatches"] == []


def test_broker_counters_say_the_same(spark, brokerRun, brokerReport):
    """
    The counters the broker logged when it stopped equal what the clients
    did (and so, by the summary's test, what its events add up to).
    """
    scenario, _, _ = brokerRun
    out, _ = brokerReport
    expected = scenario.expected
    (run,) = spark.read.parquet(str(out / "tables" / "runs")).collect()
    counters = run.counters
    assert {
        name: counters[name]
        for name in (
            "published",
            "delivered",
            "matched",
            "acked",
            "replaced",
            "dropped",
            "dropped_disconnected",
            "connections_total",
            "errors",
            "clients_dropped",
        )
    } == {
        "published": expected["publishes"],
        "delivered": expected["deliveries"],
        "matched": expected["matched"],
        "acked": expected["acked"],
        "replaced": expected["replaced"],
        "dropped": expected["dropped"],
        "dropped_disconnected": expected["dropped_disconnected"],
        "connections_total": expected["sessions"],
        "errors": expected["errors"],
        "clients_dropped": expected["clients_dropped"],
    }


def test_every_story_ended_as_expected(brokerRun, brokerReport):
    scenario, _, _ = brokerRun
    _, summary = brokerReport
    expected = scenario.expected
    for outcome in ("acked", "fired", "replaced", "dropped"):
        assert summary[outcome] == expected[outcome], outcome
    assert {reason: count for reason, count in summary["dropped_by_reason"].items() if count} == {
        name.removeprefix("dropped_"): count
        for name, count in expected.items()
        if name.startswith("dropped_")
    }
    # The broker stopped after its clients: nothing can still be in flight.
    assert summary["inflight"] == 0


def test_silent_client_session(spark, brokerRun, brokerReport):
    _, silent, _ = brokerRun
    out, _ = brokerReport
    sessions = spark.read.parquet(str(out / "tables" / "sessions"))
    (row,) = sessions.where(sessions.client == silent).collect()
    assert row.end_reason == "missed_pings"
    assert row.dropped_for_pings is True
    assert row.pings_missed == 2
    assert row.errors == 1
    assert row.publishes == 2


def test_slow_latest_subscriber_had_messages_replaced(spark, brokerRun, brokerReport):
    _, _, (slow, received) = brokerRun
    out, _ = brokerReport
    # It was sent the first message and the newest; seq jumped over the
    # three replaced in between.
    assert [(frame.payload, frame.arguments[3]) for frame in received] == [
        (b"one", b"seq=1"),
        (b"five", b"seq=5"),
    ]
    (session,) = (
        spark.read.parquet(str(out / "tables" / "sessions")).where(f"client = '{slow}'").collect()
    )
    assert (session.end_reason, session.publishes, session.deliveries, session.acks) == (
        "closed",
        5,
        2,
        2,
    )
    stories = (
        spark.read.parquet(str(out / "tables" / "deliveries"))
        .where(f"session = {session.session}")
        .orderBy("mid")
        .collect()
    )
    assert [(row.outcome, row.mode) for row in stories] == [
        ("acked", "latest"),
        ("replaced", None),
        ("replaced", None),
        ("replaced", None),
        ("acked", "latest"),
    ]
    mids = [row.mid for row in stories]
    # Each waiting message was replaced by the next.
    assert [row.replaced_by for row in stories[1:4]] == mids[2:5]
