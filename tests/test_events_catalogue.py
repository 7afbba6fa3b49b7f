"""
docs/EVENTS.md is the contract between the broker and the log analytics:
every event the broker emits, with its fields in order, must be described
there, and every counter it logs must be in its counter table.
"""

import re
from pathlib import Path

from helpers import PING_INTERVAL, BrokerHarness, FakeDatagramTransport, resultOf
from twisted.internet.defer import fail, succeed

from dallal.broker.core import BrokerConfig
from dallal.broker.delivery import DeliveryConfig
from dallal.broker.retained import RetainedStats, StoreError
from dallal.modes import ALL, FIRE, LATEST
from dallal.security.acl import parseAcl
from dallal.server import udp

# The events of a bridge's link to its remote broker.
LINK_EVENTS = ("bridge_connecting", "bridge_up", "bridge_down")

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = ROOT / "docs" / "EVENTS.md"

_EVENT_ROW = re.compile(r"^\| `(?P<name>[a-z_]+)` \| (?P<level>[a-z]+) \| (?P<fields>[^|]*) \|")
_COUNTER_ROW = re.compile(r"^\| `(?P<name>[a-z_<>]+)` \| [^|]* \|$")
_FIELD = re.compile(r"`([a-z_]+)`")

# Events the service emits, not the broker core: `listening` when a port is
# bound, `limit_lowered` at start (tests/test_limits.py checks its fields).
# Reloads on SIGHUP: the files read again, and the options that changed
# (tests/test_reload.py checks theirs).
SERVICE_EVENTS = {
    "listening",
    "limit_lowered",
    "reloaded",
    "reload_failed",
    "option_changed",
    "restart_needed",
}
# The traffic of the topics past the busiest, which takes more topics than
# the scenario has (tests/test_sysstats.py checks its fields).
TRAFFIC_OVERFLOW_EVENTS = {"topic_traffic_other"}
# The MQTT sessions that outlive their connections (tests/test_server_mqttsession.py
# checks their fields).
MQTT_SESSION_EVENTS = {
    "session_resumed",
    "session_expired",
    "sessions_restored",
    "sessions_saved",
    "sessions_not_saved",
}


def catalogue():
    """
    The events of docs/EVENTS.md, name -> (level, [field names in order]),
    and the names of its counters.
    """
    events, counters = {}, set()
    for line in CATALOGUE.read_text().splitlines():
        event = _EVENT_ROW.match(line)
        if event:
            events[event["name"]] = (event["level"], _FIELD.findall(event["fields"]))
            continue
        counter = _COUNTER_ROW.match(line)
        if counter:
            counters.add(counter["name"])
    return events, counters


def emittedInSource():
    """
    The names of the events the broker's code emits, read from its calls to
    C{EventLog.emit}.
    """
    names = set()
    for path in (ROOT / "dallal").rglob("*.py"):
        names.update(re.findall(r'\.emit\(\s*"([a-z_]+)"', path.read_text()))
    return names


class RetainedStub:
    """
    A retained store holding one message, enough to make the broker emit
    its C{retained} event.
    """

    def match(self, topicFilter):
        return [("kept/one", b"retained payload")]

    def get(self, topic):
        return b"retained payload" if topic == "kept/one" else None

    stats = RetainedStats(1, len(b"retained payload"))
    writing = False

    def topics(self):
        return iter(["kept/one"])

    def watch(self, changed):
        pass

    def set(self, topic, payload):
        if topic == "full/disk":
            return fail(StoreError("simulated full disk", "SQLITE_FULL"))
        return succeed(None)

    def close(self):
        return succeed(None)


def exerciseEveryEvent():
    """
    Drive a broker on a clock through every per-session event it has.

    @return: the harness, with the events collected.
    """
    harness = BrokerHarness(
        BrokerConfig(
            messageEvents=True,
            maxSubscriptions=1,
            delivery=DeliveryConfig(maxQueued=1, ackTimeout=1.0, maxAttempts=2),
        ),
        users={"alice": b"pw"},
        acl="user alice\ntopic readwrite #\ntopic deny private/#\n",
        bridgeUsers={"alice"},
    )
    harness.broker.retained = RetainedStub()

    def loggedIn():
        client = harness.connect()
        client.login("alice", b"pw")
        return client

    publisher = loggedIn()
    latest, every, fired, silent = (loggedIn() for _ in range(4))
    harness.connect().login("alice", b"wrong")
    publisher.send(b"PUB d private/x 1\r\nx\r\n")
    latest.send(b"SUB 1 news\r\n")
    every.send(b"SUB 2 news mode=" + ALL.encode() + b"\r\n")
    fired.send(b"SUB 3 news mode=" + FIRE.encode() + b"\r\n")
    silent.send(b"SUB 4 kept/# mode=" + LATEST.encode() + b"\r\n")
    for number in range(4):
        publisher.send(b"PUB p%d news 5\r\nhello\r\n" % (number,))
    publisher.send(b"PUB r1 full/disk 4 retain=1\r\nlost\r\n")
    # Another broker's bridge (alice is a bridge user) sends the same
    # message twice: once published, once discarded.
    for number in range(2):
        publisher.send(b"PUB b%d news 5 origin=elsewhere oid=x.1 hops=0\r\nhello\r\n" % number)
    latest.send(b"ACK 1\r\n")
    every.send(b"UNSUB 9 news\r\n")
    # Subscribing and unsubscribing over and over is logged in part.
    every.send(b"SUB 7 burst\r\nUNSUB 8 burst\r\n" * 50)
    publisher.send(b"BOGUS\r\n")
    # A flood of datagrams that name no session is logged in part.
    datagrams = udp.BrokerDatagramProtocol(harness.broker, harness.sweep)
    datagrams.makeConnection(FakeDatagramTransport())
    for port in range(40001, 40001 + udp.STRANGER_ERRORS_LOGGED_PER_SECOND + 1):
        datagrams.datagramReceived(b"BOGUS\r\n", ("127.0.0.1", port))
    latest.send(b"SUB 5 one/too/many\r\n")
    # The ACL read again takes alice's news away: her subscriptions to it end.
    harness.broker.revisePermissions(
        parseAcl("user alice\ntopic readwrite kept/#\n").permissionsFor
    )
    # A subscriber that never acks holds a publisher back with its full
    # queue (the window of 100, then one queued and one beyond), until it
    # is a slow consumer.
    flooder, stuck = loggedIn(), loggedIn()
    stuck.send(b"SUB 6 flood mode=" + ALL.encode() + b"\r\n")
    for number in range(DeliveryConfig().maxInflight + 2):
        flooder.send(b"PUB f%d flood 1\r\nf\r\n" % number)
    harness.clock.advance(DeliveryConfig().stallTimeout)
    harness.clock.advance(1.0)
    harness.clock.advance(1.0)
    # Nobody answers pings: the first sweep spares the clients that spoke
    # in its interval, the next pings them; reported, then dropped at the
    # third miss.
    for _ in range(5):
        harness.clock.advance(PING_INTERVAL)
    stopped = harness.service.stopService()
    harness.clock.advance(harness.service.shutdownGrace)
    resultOf(stopped)
    return harness


def test_everyEmittedEventIsCatalogued():
    events, _ = catalogue()
    assert emittedInSource() <= set(events), emittedInSource() - set(events)


def test_eventsCarryTheCataloguedFieldsInOrder():
    events, counters = catalogue()
    harness = exerciseEveryEvent()
    seen = set()
    for event in harness.events:
        name = event.get("dallal_event")
        if name is None:
            continue
        seen.add(name)
        level, fields = events[name]
        assert event["log_level"].name == level, name
        emitted = [key for key in harness.fields(name)[0]]
        if name == "stats":
            unknown = {
                counter
                for counter in emitted
                if counter not in counters and not counter.startswith("dropped_")
            }
            assert not unknown, unknown
        else:
            assert emitted == fields, (name, emitted, fields)
    # The scenario must reach every per-session event, or the check above
    # proves less than it claims; the service's own are tested with it, and
    # the bridges' own with their links (tests/test_bridge.py).
    notHere = SERVICE_EVENTS | set(LINK_EVENTS) | TRAFFIC_OVERFLOW_EVENTS | MQTT_SESSION_EVENTS
    assert seen == set(events) - notHere, set(events) - notHere - seen


def test_statsCountersAreCatalogued():
    _, counters = catalogue()
    harness = exerciseEveryEvent()
    (stats,) = harness.fields("stats")
    reasons = {name for name in stats if name.startswith("dropped_")}
    assert "dropped_<reason>" in counters
    assert set(stats) - reasons <= counters, set(stats) - reasons - counters


def test_everyEventNamesItsBroker():
    """
    Every event carries the broker's name, between its fields and its time
    (docs/EVENTS.md, "Format"): the logs of many brokers read together tell
    them apart.
    """
    harness = exerciseEveryEvent()
    events = [event for event in harness.events if "dallal_event" in event]
    assert events
    assert {event["broker"] for event in events} == {harness.broker.name}
    assert all(event["log_format"].endswith(" broker={broker} t={t:.6f}") for event in events)
