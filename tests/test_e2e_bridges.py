"""
Bridges end to end: three real C{twistd dallal} brokers on loopback ports,
driven by the real C{dallal} command (PROTOCOL.md, "Bridges").

  - a star (two leaves bridged to a hub) and a triangle (each broker bridged
    to the next): messages published at every broker reach every
    subscriber exactly once;
  - a hub restarted during traffic: the leaves reconnect, traffic resumes,
    and every message the subscriber missed is in some broker's log as
    dropped, or as published on the new hub before the far leaf had
    subscribed there again;
  - a leaf bridged, with its bridge user's credentials, to a hub that takes
    passwords; a leaf with a wrong password is refused;
  - a bad C{--bridge} stops twistd with a one-line reason.
"""

import json
import re
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import (
    COMMAND_TIMEOUT,
    DALLAL,
    START_TIMEOUT,
    TWISTD,
    BrokerProcess,
    OutputCollector,
    dallal,
    subscriber,
)
from test_e2e_auth import PASSWORDS, WAIT, as_, subscriberAs, writeSecurityFiles

pytestmark = pytest.mark.e2e

# Messages each broker publishes in the star and the triangle.
MESSAGES = 5
# How long the brokers may take to settle: bridges up, nothing in flight.
SETTLE_TIMEOUT = 30.0


def freePorts(count):
    """
    Loopback ports free now: a broker bridged to another must know its
    port before that one starts (in a triangle), and a restarted hub must
    come back on its own.
    """
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def events(output, name):
    """
    The fields of each event C{name} in a broker's log, as text.
    """
    found = []
    for line in output.decode("utf-8", "replace").splitlines():
        start = line.find(" event=")
        if start < 0:
            continue
        fields = dict(field.split("=", 1) for field in line[start + 1 :].split(" "))
        if fields["event"] == name:
            found.append(fields)
    return found


class Brokers:
    """
    The brokers of one test, by name, each in its own folder, on its own
    fixed port, with per-message events in its log.
    """

    def __init__(self, folder):
        self.folder = folder
        self.ports = {}
        self.processes = {}

    def start(self, *brokers):
        """
        Start brokers side by side (a bridge to one not yet started retries).

        @param brokers: C{(name, port, options)} of each.
        """
        with ThreadPoolExecutor(len(brokers)) as pool:
            started = pool.map(lambda broker: self._start(*broker), brokers)
        for (name, port, _), process in zip(brokers, started):
            self.ports[name] = port
            self.processes[name] = process

    def _start(self, name, port, options):
        folder = self.folder / name
        folder.mkdir(exist_ok=True)
        return BrokerProcess(
            [
                TWISTD,
                "-n",
                "--pidfile=",
                "dallal",
                "--tcp",
                f"tcp:{port}:interface=127.0.0.1",
                "--name",
                name,
                "--message-events",
                *options,
            ],
            folder,
        )

    def stop(self, name):
        """
        Stop one broker (cleanly, without a traceback).

        @return: its L{BrokerProcess}, with its whole log.
        """
        process = self.processes.pop(name)
        process.stop()
        return process

    def stopAll(self):
        for name in list(self.processes):
            self.stop(name)

    def waitUp(self, name, bridge, times=1):
        """
        Wait until the bridge C{bridge} of broker C{name} came up C{times}
        times.
        """
        self.processes[name].waitUntil(
            lambda output: output.count(b"event=bridge_up bridge=%s " % bridge.encode()) >= times,
            START_TIMEOUT,
            f"bridge {bridge} up {times} time(s)",
        )

    def stats(self, name):
        result = dallal("127.0.0.1", self.ports[name], "stats", "--json")
        assert result.returncode == 0, result
        return json.loads(result.stdout)

    def settle(self):
        """
        Wait until no broker has a message in flight.

        @return: each broker's stats then.
        """
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while True:
            stats = {name: self.stats(name) for name in self.processes}
            if all(each["inflight"] == 0 for each in stats.values()):
                return stats
            assert time.monotonic() < deadline, f"still in flight: {stats}"
            time.sleep(0.2)


@pytest.fixture
def brokers(tmp_path):
    brokers = Brokers(tmp_path)
    try:
        yield brokers
    finally:
        brokers.stopAll()


def publishLines(port, lines):
    """
    Publish one message per C{(topic, payload)} with one C{dallal shell}.
    """
    script = "".join(f"/pub {topic} {payload}\n" for topic, payload in lines) + "/disc\n"
    result = dallal("127.0.0.1", port, "shell", input=script.encode())
    assert result.returncode == 0, result
    assert result.stdout.count(b"published on ") == len(lines), result


def receivedLines(process):
    """
    The message lines a C{dallal subscribe} printed.
    """
    return [
        line
        for line in process.output.decode().splitlines()
        if not line.startswith("subscribing on")
    ]


def expectEachMessageOnceEverywhere(brokers):
    """
    Subscribe at every broker, publish at every broker, and check that each
    subscriber gets each message exactly once.

    @return: each broker's stats once it is over.
    """
    subscribers = {
        name: subscriber(port, "news/#", mode="all") for name, port in brokers.ports.items()
    }
    try:
        sent = []
        for name, port in brokers.ports.items():
            lines = [(f"news/{name}", f"{name}-{number}") for number in range(MESSAGES)]
            publishLines(port, lines)
            sent += [f"{topic}: {payload}" for topic, payload in lines]
        for process in subscribers.values():
            process.waitUntil(
                lambda output: output.count(b"\n") > len(sent), COMMAND_TIMEOUT, "every message"
            )
        # Once nothing is in flight anywhere, no late copy can come.
        stats = brokers.settle()
        for name, process in subscribers.items():
            assert sorted(receivedLines(process)) == sorted(sent), name
        return stats
    finally:
        for process in subscribers.values():
            process.terminate()


def test_star(brokers):
    hub, leaf1, leaf2 = freePorts(3)
    bridge = ["--bridge", f"hub=tcp:127.0.0.1:{hub}"]
    brokers.start(("hub", hub, []), ("leaf1", leaf1, bridge), ("leaf2", leaf2, bridge))
    brokers.waitUp("leaf1", "hub")
    brokers.waitUp("leaf2", "hub")
    stats = expectEachMessageOnceEverywhere(brokers)
    # The hub published both leaves' messages, and sent every message to
    # the leaf it did not come from.
    assert stats["hub"]["bridged_published"] == 2 * MESSAGES
    assert stats["hub"]["bridged_delivered"] == 4 * MESSAGES
    # A leaf: the other two brokers' messages came in, its own went out.
    assert stats["leaf1"]["bridged_published"] == 2 * MESSAGES
    assert stats["leaf1"]["bridged_delivered"] == MESSAGES
    assert stats["leaf1"]["bridges"]["hub"]["state"] == "up"
    assert stats["leaf1"]["bridges"]["hub"]["forwarded"] == MESSAGES


def test_triangle(brokers):
    a, b, c = freePorts(3)
    brokers.start(
        ("a", a, ["--bridge", f"b=tcp:127.0.0.1:{b}"]),
        ("b", b, ["--bridge", f"c=tcp:127.0.0.1:{c}"]),
        ("c", c, ["--bridge", f"a=tcp:127.0.0.1:{a}"]),
    )
    for name, bridge in (("a", "b"), ("b", "c"), ("c", "a")):
        brokers.waitUp(name, bridge)
    stats = expectEachMessageOnceEverywhere(brokers)
    for name in "abc":
        assert stats[name]["bridged_published"] == 2 * MESSAGES
    # Each message crossed bridges four times: from its broker to each of
    # the other two, then from each of these (on the first copy it got) to
    # the broker it did not come from. Those two copies arrived where the
    # message already was, and were discarded; which broker discarded which
    # depends on which copy was quicker.
    discarded = sum(stats[name]["bridged_duplicates"] for name in "abc")
    assert discarded == 2 * 3 * MESSAGES


def test_bridgeLogsInToAHubThatTakesPasswords(brokers, tmp_path):
    """
    A hub with --passwords and --bridge-users alice; a leaf whose bridge
    logs in as alice, with her password from a file, carries messages both
    ways; a leaf with a wrong password in its file is refused, and says so.
    """
    passwords, acl = writeSecurityFiles(tmp_path)
    (tmp_path / "alice.pw").write_text(PASSWORDS["alice"] + "\n")
    (tmp_path / "wrong.pw").write_text("not her password\n")
    hub, leaf, refused = freePorts(3)
    remote = f"hub=tcp:127.0.0.1:{hub},topics=news/#,user=alice"
    brokers.start(
        ("hub", hub, ["--passwords", passwords, "--acl", acl, "--bridge-users", "alice"]),
        ("leaf", leaf, ["--bridge", f"{remote},password-file={tmp_path / 'alice.pw'}"]),
        ("refused", refused, ["--bridge", f"{remote},password-file={tmp_path / 'wrong.pw'}"]),
    )
    brokers.waitUp("leaf", "hub")
    atHub = subscriberAs("bob", hub, "news/#")
    atLeaf = subscriber(leaf, "news/#", mode="all")
    try:
        publishLines(leaf, [("news/leaf", "from-the-leaf")])
        published = as_("alice", hub, "publish", "news/hub", "from-the-hub")
        assert published.returncode == 0, published
        for process in (atHub, atLeaf):
            process.waitUntil(
                lambda output: output.count(b": from-the-") == 2, WAIT, "both messages"
            )
    finally:
        for process in (atHub, atLeaf):
            process.terminate()
    for process in (atHub, atLeaf):
        assert sorted(receivedLines(process)) == [
            "news/hub: from-the-hub",
            "news/leaf: from-the-leaf",
        ]
    brokers.processes["refused"].waitFor(rb"event=bridge_down bridge=hub reason=login_failed", WAIT)
    assert b"not her password" not in brokers.stop("refused").output
    stats = json.loads(as_("alice", hub, "stats", "--json").stdout)
    assert stats["logins_failed"] >= 1
    assert stats["bridged_published"] == 1


class Publisher:
    """
    C{dallal shell} publishing C{load/<n>}, one message every C{period}
    seconds, from a thread, until told to stop.
    """

    def __init__(self, port, period=0.025):
        self.shell = OutputCollector(
            [DALLAL, "127.0.0.1", port, "shell"], None, stdin=subprocess.PIPE
        )
        self.period = period
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            self.shell.process.stdin.write(b"/pub load/%d m%d\n" % (self.sent, self.sent))
            self.shell.process.stdin.flush()
            self.sent += 1
            time.sleep(self.period)

    def waitSent(self, count):
        deadline = time.monotonic() + COMMAND_TIMEOUT
        while self.sent < count:
            assert time.monotonic() < deadline, f"only {self.sent} published"
            time.sleep(0.05)

    def stop(self):
        """
        @return: how many messages were published.
        """
        self._stop.set()
        self._thread.join(COMMAND_TIMEOUT)
        self.shell.process.stdin.write(b"/disc\n")
        self.shell.process.stdin.close()
        self.shell.process.wait(COMMAND_TIMEOUT)
        assert self.shell.output.count(b"published on ") == self.sent, self.shell.output
        return self.sent


def loadNumbers(messageEvents):
    """
    The numbers of the C{load/<n>} messages some events are about.
    """
    return {
        int(event["topic"].split("/")[1])
        for event in messageEvents
        if event["topic"].startswith("load/")
    }


def test_hubRestartDuringTraffic(brokers):
    hub, leaf1, leaf2 = freePorts(3)
    bridge = ["--bridge", f"hub=tcp:127.0.0.1:{hub}"]
    # The first leaf queues at most 10 messages while the hub is away, and
    # holds its publisher back for half a second only: then its bridge is a
    # slow consumer, and its queue drops its oldest.
    brokers.start(
        ("hub", hub, []),
        ("leaf1", leaf1, [*bridge, "--max-queued", "10", "--stall-timeout", "0.5"]),
        ("leaf2", leaf2, bridge),
    )
    brokers.waitUp("leaf1", "hub")
    brokers.waitUp("leaf2", "hub")
    watcher = subscriber(leaf2, "load/#", mode="all")
    publisher = Publisher(leaf1)
    try:
        publisher.waitSent(40)
        oldHub = brokers.stop("hub")
        brokers.start(("hub", hub, []))
        brokers.waitUp("leaf1", "hub", times=2)
        brokers.waitUp("leaf2", "hub", times=2)
        resumedAt = publisher.sent
        publisher.waitSent(resumedAt + 40)
    finally:
        published = publisher.stop()
    try:
        stats = brokers.settle()
    finally:
        watcher.terminate()

    received = [
        int(re.fullmatch(r"load/(\d+): m\1", line).group(1)) for line in receivedLines(watcher)
    ]
    assert len(received) == len(set(received)), "a message arrived twice"
    missing = set(range(published)) - set(received)
    # Traffic resumed: everything published once both leaves were back.
    assert not {number for number in missing if number >= resumedAt}
    # Every loss is accounted for, message by message.
    logs = {
        "leaf1": brokers.processes["leaf1"].output,
        "old hub": oldHub.output,
        "new hub": brokers.processes["hub"].output,
        "leaf2": brokers.processes["leaf2"].output,
    }
    dropped = {where: loadNumbers(events(log, "drop")) for where, log in logs.items()}
    unrouted = loadNumbers(
        event for event in events(logs["new hub"], "publish") if event["subscribers"] == "0"
    )
    unexplained = missing - set().union(*dropped.values()) - unrouted
    assert not unexplained, (sorted(unexplained), dropped, unrouted)
    # The outage overflowed the first leaf's queue: counted as dropped on
    # the way to the hub, as its stats say.
    leaf1 = stats["leaf1"]
    assert leaf1["dropped_queue_full"] == len(dropped["leaf1"]) > 0
    assert leaf1["bridged_dropped"] == leaf1["dropped"] == leaf1["dropped_queue_full"]
    assert leaf1["bridges"]["hub"]["connects"] == 2


@pytest.mark.parametrize(
    "option, reason",
    [
        ("hub=bogus:x", b"--bridge hub: 'bogus:x' is not a client endpoint description"),
        ("hub=tcp:h:1,direction=up", b"--bridge hub: direction must be one of in, out, both"),
        ("hub=tcp:h:1,topics=a#", b"--bridge hub: bad topic filter 'a#'"),
    ],
)
def test_badBridgeStopsTwistdWithTheReason(tmp_path, option, reason):
    result = subprocess.run(
        [TWISTD, "-n", "--pidfile=", "dallal", "--bridge", option],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )
    assert result.returncode == 1
    lastLine = (result.stdout + result.stderr).strip().splitlines()[-1]
    assert reason in lastLine, lastLine
    assert b"Traceback" not in result.stdout + result.stderr
