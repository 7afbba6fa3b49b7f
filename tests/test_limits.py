"""
The broker's limits (L{dallal.limits}; README.md, "Limits"): each one at its
boundary -- N allowed, N+1 refused with a clear error, counted and logged --
and its place free again once a client leaves; their options; and the one
a user meets first, end to end.
"""

import json
import re

import pytest
import pytest_twisted
from helpers import (
    PING_INTERVAL,
    REPO,
    STOP_TIMEOUT,
    TWISTD,
    BrokerHarness,
    BrokerProcess,
    OutputCollector,
    UdpHarness,
    dallal,
    subscriber,
)
from test_events_catalogue import catalogue
from twisted.internet import reactor
from twisted.internet.address import UNIXAddress
from twisted.internet.testing import StringTransport
from twisted.logger import formatEvent, globalLogPublisher
from twisted.python import usage

from dallal import __version__, limits
from dallal.broker.core import BrokerConfig
from dallal.broker.delivery import DISCONNECT, DeliveryConfig
from dallal.server.tap import Options, brokerConfig, makeService
from dallal.server.tcp import REFUSAL_GRACE, RefusedConnection

# The beginnings of the errors these limits answer with, which
# tests/test_server_tcp.py counts as tested.
TOO_MANY_CLIENTS_ERROR = b"ERR - TOO_MANY_CLIENTS "
TOO_MANY_SUBSCRIPTIONS_ERROR = b"ERR 3 TOO_MANY_SUBSCRIPTIONS "


def limitEvents(harness):
    return harness.fields("limit_reached")


# TCP connections, in all and per address


def test_connectionsUpToTheLimit():
    harness = BrokerHarness(BrokerConfig(maxConnections=2))
    admitted = [harness.connect(), harness.connect()]
    refused = harness.connect()
    assert refused.received() == (
        b"ERR - TOO_MANY_CLIENTS the broker has its maximum of 2 connections: try again later\r\n"
    )
    assert refused.closing
    for client in admitted:
        client.send(b"PING\r\n")
        assert client.received() == b"PONG\r\n"
        assert not client.closing
    stats = harness.broker.stats()
    assert (stats["connections"], stats["refused_connections"]) == (2, 1)
    assert limitEvents(harness) == [
        {
            "limit": "connections",
            "max": 2,
            "session": 0,
            "client": refused.address,
            "transport": "tcp",
            "refused": 1,
        }
    ]
    # A refused connection is no session: it is not logged as one.
    assert len(harness.fields("connect")) == 2


def test_connectionsPerAddress():
    harness = BrokerHarness(BrokerConfig(maxConnectionsPerIp=2))
    harness.connect("10.0.0.1"), harness.connect("10.0.0.1")
    refused = harness.connect("10.0.0.1")
    assert refused.received() == (
        b"ERR - TOO_MANY_CLIENTS the broker has its maximum of 2 connections from 10.0.0.1: "
        b"try again later\r\n"
    )
    assert refused.closing
    other = harness.connect("10.0.0.2")
    other.send(b"PING\r\n")
    assert other.received() == b"PONG\r\n"
    stats = harness.broker.stats()
    assert (stats["refused_connections_per_ip"], stats["refused_connections"]) == (1, 0)
    assert limitEvents(harness)[0]["limit"] == "connections_per_ip"


def test_unixSocketConnectionsCountOnlyInTheTotal():
    harness = BrokerHarness(BrokerConfig(maxConnections=2, maxConnectionsPerIp=1))
    built = []
    for _ in range(3):
        protocol = harness.factory.buildProtocol(UNIXAddress(None))
        protocol.makeConnection(StringTransport())
        built.append(protocol)
    assert not isinstance(built[1], RefusedConnection)
    assert isinstance(built[2], RefusedConnection)
    assert built[2].error.reason == "the broker has its maximum of 2 connections: try again later"


def _closedByClient(harness, client):
    client.lose()


def _bye(harness, client):
    client.send(b"BYE\r\n")
    assert client.closing
    client.lose()


def _fatalError(harness, client):
    client.send(b"x" * (harness.broker.config.maxControlLine + 2))
    assert client.closing
    client.lose()


def _missedPings(harness, client):
    # A ping, then three intervals without its pong.
    for _ in range(4):
        harness.clock.advance(PING_INTERVAL)
    assert client.closing
    client.lose()


def _slowConsumer(harness, client):
    client.send(b"SUB 1 news mode=all\r\n")
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 1\r\na\r\nPUB 2 news 1\r\nb\r\nPUB 3 news 1\r\nc\r\n")
    harness.clock.advance(DeliveryConfig().stallTimeout)
    assert client.closing
    client.lose()
    publisher.lose()


def _shutdown(harness, client):
    harness.broker.shutdown()
    assert client.closing
    client.lose()


@pytest.mark.parametrize(
    "disconnect",
    [_closedByClient, _bye, _fatalError, _missedPings, _slowConsumer, _shutdown],
    ids=lambda function: function.__name__.lstrip("_"),
)
def test_everyDisconnectFreesItsPlace(disconnect):
    """
    However a connection ends, it no longer counts against the limits.
    """
    harness = BrokerHarness(
        BrokerConfig(
            maxConnections=2,
            maxConnectionsPerIp=2,
            delivery=DeliveryConfig(maxInflight=1, maxQueued=1, slowConsumer=DISCONNECT),
        )
    )
    disconnect(harness, harness.connect())
    assert (harness.factory.connections.total, dict(harness.factory.connections.perHost)) == (
        0,
        {},
    )
    for _ in range(2):
        harness.connect()
    assert harness.factory.connections.total == 2
    assert harness.broker.stats()["refused_connections"] == 0


def test_placeFreedIsTakenAgain():
    harness = BrokerHarness(BrokerConfig(maxConnections=1))
    first = harness.connect()
    assert harness.connect().received().startswith(TOO_MANY_CLIENTS_ERROR)
    first.lose()
    again = harness.connect()
    again.send(b"PING\r\n")
    assert again.received() == b"PONG\r\n"


class HalfClosingTransport(StringTransport):
    """
    A TCP transport as far as closing goes: it can close its writing side
    alone.
    """

    writeClosed = False

    def loseWriteConnection(self):
        self.writeClosed = True


def test_refusedConnectionReadsUntilTheClientCloses():
    """
    A refused connection stops writing after its ERR, but keeps reading
    (closing with unread bytes would reset the connection, and the ERR with
    it) until the client closes, or REFUSAL_GRACE is over.
    """
    harness = BrokerHarness(BrokerConfig(maxConnections=1))
    harness.connect()
    transport = HalfClosingTransport()
    refused = harness.connect(transport=transport)
    assert refused.received().startswith(TOO_MANY_CLIENTS_ERROR)
    assert transport.writeClosed and not transport.disconnecting
    refused.send(b"PUB 1 news 2\r\nhi\r\n")
    assert refused.received() == b""
    harness.clock.advance(REFUSAL_GRACE)
    assert transport.disconnected
    assert harness.broker.stats()["published"] == 0


def test_refusedConnectionClosedByItsClientLeavesNoTimer():
    harness = BrokerHarness(BrokerConfig(maxConnections=1))
    harness.connect()
    timers = len(harness.clock.getDelayedCalls())
    refused = harness.connect(transport=HalfClosingTransport())
    assert len(harness.clock.getDelayedCalls()) == timers + 1
    refused.lose()
    assert len(harness.clock.getDelayedCalls()) == timers


# Subscriptions


def test_subscriptionsUpToTheLimit():
    harness = BrokerHarness(BrokerConfig(maxSubscriptions=2))
    client = harness.connect()
    client.send(b"SUB 1 a\r\nSUB 2 b/#\r\n")
    assert client.received() == b"SUBACK 1\r\nSUBACK 2\r\n"
    client.send(b"SUB 3 c\r\n")
    answer = client.received()
    assert answer == (
        TOO_MANY_SUBSCRIPTIONS_ERROR
        + b"this client has its maximum of 2 subscriptions: unsubscribe from one first\r\n"
    )
    assert not client.closing
    # The same filter again changes its subscription: no new one.
    client.send(b"SUB 4 a mode=fire\r\n")
    assert client.received() == b"SUBACK 4\r\n"
    client.send(b"UNSUB 5 b/#\r\nSUB 6 c\r\n")
    assert client.received() == b"UNSUBACK 5\r\nSUBACK 6\r\n"
    assert harness.broker.stats()["refused_subscriptions"] == 1
    assert harness.fields("protocol_error")[0]["code"] == "TOO_MANY_SUBSCRIPTIONS"
    [event] = limitEvents(harness)
    assert (event["limit"], event["max"], event["session"]) == ("subscriptions", 2, 1)


def test_helloTellsTheLimitsOnRequests():
    harness = BrokerHarness(
        BrokerConfig(
            maxPayload=100,
            maxTopicLength=64,
            maxTopicLevels=8,
            maxSubscriptions=5,
            maxControlLine=1024,
        )
    )
    client = harness.connect()
    client.send(b"HELLO 1 me\r\n")
    assert client.received() == (
        b"HELLO 1 version=%s ping=10 max-payload=100 max-topic=64 max-levels=8 "
        b"max-subscriptions=5 max-line=1024\r\n" % __version__.encode()
    )


def test_subscriptionsAreCountedPerClient():
    harness = BrokerHarness(BrokerConfig(maxSubscriptions=1))
    first, second = harness.connect(), harness.connect()
    first.send(b"SUB 1 a\r\n")
    second.send(b"SUB 1 a\r\n")
    assert first.received() == second.received() == b"SUBACK 1\r\n"


# Topics: length and levels, in PUB topics and SUB filters

TOPIC_CONFIG = BrokerConfig(maxTopicLength=16, maxTopicLevels=4)
# What " client=<id> token=<token>" adds to a UDP request of Peer's.
IDENTITY = len(b" client=client-1 token=") + 16
LONGEST = "t" * 16
DEEPEST = "a/b/c/d"


def _publish(topic):
    return b"PUB 1 %s 2\r\nhi\r\n" % topic.encode()


def _publishToMatching(topic):
    return b"PUB 1 %s 2 to-matching=1\r\nhi\r\n" % topic.encode()


def _subscribe(topic):
    return b"SUB 1 %s\r\n" % topic.encode()


REQUESTS = {
    "topic": [_publish],
    "filter": [_publishToMatching, _subscribe],
}


@pytest.mark.parametrize(
    "request_, what",
    [(make, what) for what, makes in REQUESTS.items() for make in makes],
    ids=lambda value: getattr(value, "__name__", value).lstrip("_"),
)
@pytest.mark.parametrize(
    "accepted, refused, limit, reason",
    [
        (LONGEST, LONGEST + "t", limits.TOPIC_LENGTH, "is 17 bytes, longer than 16"),
        (DEEPEST, DEEPEST + "/e", limits.TOPIC_LEVELS, "has 5 levels, more than the maximum of 4"),
    ],
    ids=["length", "levels"],
)
def test_topicLimits(request_, what, accepted, refused, limit, reason):
    harness = BrokerHarness(TOPIC_CONFIG)
    client = harness.connect()
    client.send(request_(accepted))
    assert b"ERR" not in client.received()
    client.send(request_(refused))
    assert client.received() == b"ERR 1 BAD_TOPIC %s %s\r\n" % (what.encode(), reason.encode())
    assert not client.closing
    assert harness.broker.stats()[limit.counter] == 1
    assert limitEvents(harness)[0]["limit"] == limit.name


# Control lines


def test_controlLineUpToTheLimit():
    harness = BrokerHarness(BrokerConfig(maxControlLine=512))
    client = harness.connect()
    client.send(b"PING" + b" " * 508 + b"\r\n")
    assert client.received() == b"PONG\r\n"
    client.send(b"PING" + b" " * 509 + b"\r\n")
    assert client.received() == b"ERR - LINE_TOO_LONG control line longer than 512 bytes\r\n"
    assert client.closing
    assert harness.broker.stats()["refused_line"] == 1
    assert limitEvents(harness)[0]["limit"] == "line"


def test_controlLineIsNotBufferedBeyondTheLimit():
    """
    Bytes without a line end are refused once there are more than the
    limit, not when the line end comes.
    """
    harness = BrokerHarness(BrokerConfig(maxControlLine=512))
    client = harness.connect()
    client.send(b"x" * 513)
    assert not client.closing
    client.send(b"x")
    assert client.received().startswith(b"ERR - LINE_TOO_LONG ")
    assert client.closing


# The limits on requests, at their boundary over either transport.

REQUEST_LIMITS = {
    "subscriptions": (
        BrokerConfig(maxSubscriptions=1),
        [(b"SUB 1 a", None), (b"SUB 3 b", None)],
        [
            b"SUBACK 1\r\n",
            TOO_MANY_SUBSCRIPTIONS_ERROR
            + b"this client has its maximum of 1 subscriptions: unsubscribe from one first\r\n",
        ],
    ),
    "topic_levels": (
        TOPIC_CONFIG,
        [(b"PUB 1 %s 2" % DEEPEST.encode(), b"hi"), (b"PUB 2 %s/e 2" % DEEPEST.encode(), b"hi")],
        [b"PUBACK 1\r\n", b"ERR 2 BAD_TOPIC topic has 5 levels, more than the maximum of 4\r\n"],
    ),
    "topic_length": (
        TOPIC_CONFIG,
        [(b"SUB 1 %s" % LONGEST.encode(), None), (b"SUB 2 %st" % LONGEST.encode(), None)],
        [b"SUBACK 1\r\n", b"ERR 2 BAD_TOPIC filter is 17 bytes, longer than 16\r\n"],
    ),
    "payload": (
        BrokerConfig(maxPayload=16),
        [(b"PUB 1 news 16", b"x" * 16), (b"PUB 2 news 17", b"x" * 17)],
        [
            b"PUBACK 1\r\n",
            b"ERR 2 PAYLOAD_TOO_LARGE payload of 17 bytes is larger than the maximum of 16\r\n",
        ],
    ),
}


def _overTcp(config, requests):
    harness = BrokerHarness(config)
    client = harness.connect()
    answers = []
    for line, payload in requests:
        client.send(line + b"\r\n" + (b"" if payload is None else payload + b"\r\n"))
        answers.append(client.received())
    assert not client.closing
    return harness, answers


def _overUdp(config, requests):
    harness = UdpHarness(config)
    peer = harness.peer(40001)
    peer.hello()
    for line, payload in requests:
        peer.request(line, payload)
    return harness, peer.received()


@pytest.mark.parametrize("transport", [_overTcp, _overUdp], ids=["tcp", "udp"])
@pytest.mark.parametrize("limit", REQUEST_LIMITS)
def test_requestLimits(limit, transport):
    config, requests, expected = REQUEST_LIMITS[limit]
    harness, answers = transport(config, requests)
    assert answers == expected
    assert harness.broker.stats()["refused_" + limit] == 1
    [event] = limitEvents(harness)
    assert (event["limit"], event["session"], event["refused"]) == (limit, 1, 1)


def test_controlLineOverUdp():
    """
    The client's identity is part of the line.
    """
    harness, answers = _overUdp(
        BrokerConfig(maxControlLine=512),
        [(b"PING" + b" " * (508 - IDENTITY), None), (b"PING" + b" " * (509 - IDENTITY), None)],
    )
    assert answers == [b"PONG\r\n", b"ERR - LINE_TOO_LONG control line longer than 512 bytes\r\n"]
    assert harness.broker.stats()["refused_line"] == 1


# UDP sessions


def test_udpClientsUpToTheLimit():
    harness = UdpHarness(BrokerConfig(maxUdpClients=2))
    alice, bob, carol = (harness.peer(port) for port in (40001, 40002, 40003))
    alice.hello("alice")
    bob.hello("bob")
    refused = carol.hello("carol")
    assert refused == (
        b"ERR 2 TOO_MANY_CLIENTS the broker has its maximum of 2 UDP clients: try again later\r\n"
    )
    assert harness.counter("connections") == 2
    assert harness.counter("refused_udp_clients") == 1
    # A session that moves is no new one.
    assert b"session=resumed" in harness.peer(40004).hello("alice", key=alice.key)
    bob.request(b"BYE")
    assert b"session=new" in carol.hello("carol")


def test_udpClientsPerIpUpToTheLimit():
    """
    One host may hold --max-udp-clients-per-ip sessions: the next HELLO
    from it is refused, counted and logged, while another host still gets
    its session; a session that moves to the full host counts there.
    """
    harness = UdpHarness(BrokerConfig(maxUdpClientsPerIp=2))
    alice, bob, mallory = (harness.peer(port) for port in (40001, 40002, 40003))
    alice.hello("alice")
    bob.hello("bob")
    assert mallory.hello("mallory") == (
        b"ERR 2 TOO_MANY_CLIENTS the broker has its maximum of 2 UDP clients from "
        b"127.0.0.1: try again later\r\n"
    )
    assert harness.counter("refused_udp_clients_per_ip") == 1
    [event] = limitEvents(harness)
    assert (event["limit"], event["max"]) == ("udp_clients_per_ip", 2)
    carol = harness.peer(40001, host="127.0.0.2")
    assert b"session=new" in carol.hello("carol")
    bob.request(b"BYE")
    assert b"session=new" in mallory.hello("mallory")
    assert b"session=resumed" in harness.peer(40005, host="127.0.0.2").hello("alice", key=alice.key)
    assert b"session=new" in harness.peer(40006).hello("dave")


def test_udpClientPlaceFreedByExpiry():
    harness = UdpHarness(BrokerConfig(maxUdpClients=1))
    harness.peer(40001).hello("alice")
    for _ in range(4):
        harness.clock.advance(PING_INTERVAL)
    assert b"session=new" in harness.peer(40002).hello("bob")


# Hellos per second from one address


# A first HELLO long enough to be answered from an unknown address.
HELLO = b"HELLO 1 someone pad=%s\r\n" % (b"x" * 32)


def test_hellosPerSecondFromOneAddress():
    harness = UdpHarness(BrokerConfig(maxHellosPerSecond=3))
    peers = [harness.peer(port) for port in (40001, 40002, 40003, 40004)]
    for peer in peers:
        peer.send(HELLO)
    # Another port of the same address is the same address.
    assert [len(peer.received()) for peer in peers] == [1, 1, 1, 0]
    assert harness.counter("refused_hello_rate") == 1
    [event] = limitEvents(harness)
    assert (event["limit"], event["max"], event["client"]) == ("hello_rate", 3, "127.0.0.1:40004")
    other = harness.peer(40001, host="127.0.0.2")
    other.send(HELLO)
    assert len(other.received()) == 1
    # A third of a second later, the rate allows one more.
    harness.clock.advance(1 / 3)
    peers[3].send(HELLO)
    assert len(peers[3].received()) == 1


def test_rateTableIsBounded():
    """
    A forger of source addresses cannot grow the table: the address heard
    from least recently is forgotten first.
    """
    harness = UdpHarness()
    table = limits.RateTable(harness.clock, rate=1, size=3)
    for key in ("a", "b", "c"):
        assert table.allow(key)
    assert not table.allow("a")
    assert table.allow("d")
    assert len(table) == 3
    # "b" was forgotten, so it starts again with a full bucket; "a" was not.
    assert table.allow("b")
    assert not table.allow("a")


# Logging: at most one event a second per limit


def test_logWindow():
    """
    A window starts with the first event after the last one ended, and
    allows C{perWindow} events in it.
    """
    window = limits.LogWindow(perWindow=2, seconds=1)
    assert [window.allow(now) for now in (10, 10.2, 10.9, 11.0, 11.5, 11.9, 12.1)] == [
        True,
        True,
        False,
        True,
        True,
        False,
        True,
    ]


def test_limitEventsAreThrottledPerLimit():
    harness = BrokerHarness(BrokerConfig(maxConnections=1, maxSubscriptions=1))
    client = harness.connect()
    for _ in range(5):
        harness.connect()
    client.send(b"SUB 1 a\r\nSUB 2 b\r\n")
    harness.clock.advance(limits.LOG_INTERVAL)
    harness.connect()
    assert [(event["limit"], event["refused"]) for event in limitEvents(harness)] == [
        ("connections", 1),
        ("subscriptions", 1),
        ("connections", 5),
    ]
    assert harness.broker.stats()["refused_connections"] == 6


# Options

LIMIT_OPTIONS = {
    "max-connections": "maxConnections",
    "max-connections-per-ip": "maxConnectionsPerIp",
    "max-udp-clients": "maxUdpClients",
    "max-udp-clients-per-ip": "maxUdpClientsPerIp",
    "max-hellos-per-second": "maxHellosPerSecond",
    "max-subscriptions": "maxSubscriptions",
    "max-topic-length": "maxTopicLength",
    "max-topic-levels": "maxTopicLevels",
    "max-payload": "maxPayload",
    "max-line": "maxControlLine",
    "max-output-bytes": "maxOutputBytes",
    "max-consecutive-errors": "maxConsecutiveErrors",
    "max-frame-seconds": "maxFrameSeconds",
    "max-pending-logins": "maxPendingLogins",
    "max-pending-logins-per-ip": "maxPendingLoginsPerIp",
    "max-udp-answer-bytes": "maxUdpAnswerBytes",
    "max-udp-answer-bytes-total": "maxUdpAnswerBytesTotal",
    "max-matching-topics": "maxMatchingTopics",
    "max-listed": "maxListed",
    "max-retained": "maxRetained",
    "max-retained-bytes": "maxRetainedBytes",
}


# The queues' limits, of dallal.broker.delivery, are in the same table.
QUEUE_OPTIONS = ["max-queued", "max-queued-bytes"]
# And the MQTT sessions' (dallal.server.mqttsession).
SESSION_OPTIONS = ["max-offline-sessions", "max-offline-bytes"]


class FakeRlimit:
    """
    The C{resource} module as far as the descriptor limit goes.

    @ivar hard: the hard limit; the soft one may be raised up to it.
    """

    RLIMIT_NOFILE = 7
    RLIM_INFINITY = -1

    def __init__(self, soft, hard):
        self.soft = soft
        self.hard = hard

    def getrlimit(self, which):
        assert which == self.RLIMIT_NOFILE
        return self.soft, self.hard

    def setrlimit(self, which, limits):
        soft, hard = limits
        if hard != self.hard or (self.hard != self.RLIM_INFINITY and soft > self.hard):
            raise ValueError("not allowed")
        self.soft = soft


def parsed(*arguments):
    options = Options()
    options.parseOptions(list(arguments))
    return options


def test_eachLimitOptionSetsItsLimit():
    values = {option: str(600 + number) for number, option in enumerate(LIMIT_OPTIONS)}
    values["max-topic-length"] = "100"
    arguments = [item for option, value in values.items() for item in (f"--{option}", value)]
    config = brokerConfig(parsed(*arguments))
    assert {option: str(getattr(config, name)) for option, name in LIMIT_OPTIONS.items()} == (
        values
    )


def test_defaultsAreTheConfigsDefaults():
    config = brokerConfig(parsed())
    assert config == BrokerConfig(messageEvents=False, delivery=config.delivery)


BAD_VALUES = [
    ("abc", "not 'abc'"),
    ("1.5", "not '1.5'"),
    ("-1", "not '-1'"),
    ("0", "not '0'"),
]


@pytest.mark.parametrize("value, says", BAD_VALUES, ids=[value for value, _ in BAD_VALUES])
@pytest.mark.parametrize("option", LIMIT_OPTIONS)
def test_badLimitValues(option, value, says):
    with pytest.raises(usage.UsageError) as error:
        Options().parseOptions([f"--{option}", value])
    assert str(error.value).startswith(f"--{option} must be a whole number ")
    assert str(error.value).endswith(says)


def test_readmeListsEveryLimitWithItsDefault():
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Limits\n") :]
    section = section[: section.index("\n### ", 1)]
    listed = dict(re.findall(r"^\| `--(max-[a-z-]+)` \| `(\d+)` \|", section, re.MULTILINE))
    defaults = {name: str(value) for name, value in Options().defaults.items()}
    options = [*LIMIT_OPTIONS, *QUEUE_OPTIONS, *SESSION_OPTIONS]
    assert listed == {option: defaults[option] for option in options}


@pytest.mark.parametrize(
    "option, value, bounds",
    [
        ("max-topic-length", "257", "from 1 to 256"),
        ("max-line", "511", "from 512 to 65536"),
        ("max-line", "65537", "from 512 to 65536"),
    ],
)
def test_limitValuesOutOfBounds(option, value, bounds):
    with pytest.raises(usage.UsageError) as error:
        Options().parseOptions([f"--{option}", value])
    assert str(error.value) == f"--{option} must be a whole number {bounds}, not '{value}'"


@pytest.mark.e2e
def test_badValueStopsTwistdWithOneLine(tmp_path):
    """
    twistd prints its usage, then the reason on one line, and exits.
    """
    process = OutputCollector(
        [TWISTD, "-n", "--pidfile=", "dallal", "--max-connections", "ten"], tmp_path
    )
    assert process.process.wait(30) != 0
    process.kill()
    lastLine = process.output.decode().rstrip("\n").splitlines()[-1]
    assert lastLine.endswith(": --max-connections must be a whole number of at least 1, not 'ten'")


# The descriptor limit


@pytest.mark.parametrize(
    "soft, hard, expected",
    [
        # Room enough already.
        (2000, 2000, (1000, 2000)),
        # The soft limit is raised as far as needed.
        (1024, 4096, (1000, 1032)),
        (1024, FakeRlimit.RLIM_INFINITY, (1000, 1032)),
        # ... or as far as the hard limit allows, and the limit lowered.
        (256, 512, (480, 512)),
    ],
)
def test_fitToDescriptors(soft, hard, expected):
    rlimit = FakeRlimit(soft, hard)
    assert limits.fitToDescriptors(1000, rlimit) == expected
    assert rlimit.soft == expected[1]


@pytest_twisted.ensureDeferred
async def test_connectionLimitLoweredToTheDescriptorsIsLogged(tmp_path):
    logged = []
    globalLogPublisher.addObserver(logged.append)
    try:
        service = makeService(
            parsed("--data-dir", str(tmp_path), "--max-connections", "1000"),
            rlimit=FakeRlimit(256, 512),
        )
    finally:
        globalLogPublisher.removeObserver(logged.append)
    await service.broker.retained.close().addTimeout(STOP_TIMEOUT, reactor)
    assert service.broker.config.maxConnections == 480
    assert service.factory.connections.maxTotal == 480
    [event] = [event for event in logged if event.get("dallal_event") == "limit_lowered"]
    level, fields = catalogue()[0]["limit_lowered"]
    assert event["log_level"].name == level
    assert formatEvent(event).startswith(
        "event=limit_lowered "
        + " ".join(
            f"{name}={value}"
            for name, value in zip(fields, ["connections", 480, 1000, 512], strict=True)
        )
        + f" broker={service.broker.name} t="
    )


# End to end


@pytest.mark.e2e
def test_clientOverTheConnectionLimitIsToldWhy(tmp_path):
    """
    With C{--max-connections 2} and two subscribers connected, a third
    C{dallal} command is refused with the reason; once a subscriber has
    gone, its place is free for the next command.
    """
    broker = BrokerProcess.plugin(tmp_path, "--max-connections", "2")
    subscribers = []
    try:
        subscribers.append(subscriber(broker.port, "news"))
        subscribers.append(subscriber(broker.port, "sport"))
        result = dallal("127.0.0.1", broker.port, "publish", "news", "hello")
        assert (result.returncode, result.stdout) == (1, b"your message publishing failed\n")
        assert result.stderr == (
            b"dallal: the broker at 127.0.0.1:%d closed the connection: TOO_MANY_CLIENTS: "
            b"the broker has its maximum of 2 connections: try again later\n" % broker.port
        )
        broker.waitFor(rb"event=limit_reached limit=connections max=2 session=0 ")
        assert subscribers.pop().terminate() == 0
        broker.waitFor(rb"event=disconnect session=2 ")
        result = dallal("127.0.0.1", broker.port, "stats", "--json")
        assert result.returncode == 0, result.stderr
        stats = json.loads(result.stdout)
        assert (stats["connections"], stats["refused_connections"]) == (2, 1)
    finally:
        for process in subscribers:
            process.kill()
        broker.stop()


# Delivery queues: what a full one costs is the slow-consumer policy's
# (tests/test_delivery.py); here, that it is counted and logged.


@pytest.mark.parametrize(
    "delivery, payloads, limit",
    [
        (DeliveryConfig(maxInflight=1, maxQueued=2), [b"a", b"b", b"c"], limits.QUEUED_MESSAGES),
        (
            DeliveryConfig(maxInflight=1, maxQueuedBytes=10),
            [b"x", b"12345", b"67890"],
            limits.QUEUED_BYTES,
        ),
    ],
    ids=["messages", "bytes"],
)
def test_queueLimits(delivery, payloads, limit):
    """
    With one message in flight unacked, the queue behind it takes up to its
    limit; the next message finds it full, and once the client is a slow
    consumer (no ack for the stall timeout) one message is dropped.  Once
    the client acks, a place is free again.
    """
    harness = BrokerHarness(BrokerConfig(delivery=delivery))
    subscriber, publisher = harness.connect(), harness.connect()
    subscriber.send(b"SUB 1 news mode=all\r\n")
    for number, payload in enumerate(payloads):
        publisher.send(b"PUB %d news %d\r\n%s\r\n" % (number, len(payload), payload))
    assert harness.broker.stats()[limit.counter] == 0
    publisher.send(b"PUB 9 news 1\r\nz\r\n")
    assert harness.broker.stats()[limit.counter] == 0
    harness.clock.advance(delivery.stallTimeout)
    stats = harness.broker.stats()
    assert (stats[limit.counter], stats["dropped_queue_full"]) == (1, 1)
    [event] = limitEvents(harness)
    assert (event["limit"], event["session"], event["client"]) == (
        limit.name,
        1,
        subscriber.address,
    )
    subscriber.send(b"ACK 1\r\n")
    publisher.send(b"PUB 10 news 1\r\nz\r\n")
    assert harness.broker.stats()[limit.counter] == 1
