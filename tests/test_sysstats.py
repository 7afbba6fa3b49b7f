"""
The broker's statistics on C{$SYS/broker/...} (PROTOCOL.md, "Broker
statistics"), published by a L{SysPublisher} on a clock and read through the
broker's TCP protocol.
"""

import pytest
from helpers import BrokerHarness, BrokerProcess, dallal, messages, subscriber
from twisted.logger import Logger

from dallal.broker.sysstats import LOAD_WINDOWS, PREFIX, SysPublisher

INTERVAL = 10.0


def sysHarness():
    harness = BrokerHarness()
    publisher = SysPublisher(harness.broker, harness.clock, INTERVAL)
    publisher.start()
    return harness, publisher


def values(client):
    """
    The C{$SYS} values a client received since the last call, by topic (the
    last one of each).
    """
    return {topic.decode(): payload.decode() for topic, payload in messages(client.received())}


def subscribe(client, topicFilter, requestId=b"1"):
    client.send(b"SUB %s %s mode=fire\r\n" % (requestId, topicFilter))


def test_aNewSubscriberGetsTheLastValuesAtOnce():
    harness, _ = sysHarness()
    client = harness.connect()
    harness.clock.advance(INTERVAL)
    subscribe(client, b"$SYS/#")
    received = values(client)
    # As the last round found them.
    assert received[PREFIX + "clients/connected"] == "1"
    assert received[PREFIX + "subscriptions/count"] == "0"
    assert received[PREFIX + "uptime"] == "10"
    assert received[PREFIX + "version"].startswith("dallal ")
    for window in LOAD_WINDOWS:
        assert received[PREFIX + f"load/messages/received/{window}"] == "0.00"


def test_changedValuesArePublishedEveryInterval():
    harness, _ = sysHarness()
    watcher = harness.connect()
    subscribe(watcher, b"$SYS/broker/#")
    watcher.received()
    publisher = harness.connect()
    for number in range(3):
        publisher.send(b"PUB %d news 5\r\nhello\r\n" % number)

    harness.clock.advance(INTERVAL - 1)
    assert values(watcher) == {}, "nothing before the interval is over"

    harness.clock.advance(1)
    received = values(watcher)
    assert received[PREFIX + "messages/received"] == "3"
    assert received[PREFIX + "bytes/received"] == "15"
    assert received[PREFIX + "clients/connected"] == "2"
    assert received[PREFIX + "uptime"] == "10"
    # What did not change is not published again.
    assert PREFIX + "version" not in received
    assert PREFIX + "messages/replaced" not in received


def test_loadsAreMessagesPerSecondAveragedOverTheirWindow():
    harness, _ = sysHarness()
    watcher = harness.connect()
    subscribe(watcher, b"$SYS/broker/load/messages/received/+")
    publisher = harness.connect()
    # 2 messages a second for ten minutes (and the pongs that keep both
    # clients connected).
    for second in range(600):
        publisher.send(b"PUB %d news 1\r\nx\r\nPUB b%d news 1\r\ny\r\n" % (second, second))
        publisher.send(b"PONG\r\n")
        watcher.send(b"PONG\r\n")
        harness.clock.advance(1)
    received = values(watcher)
    oneMinute = float(received[PREFIX + "load/messages/received/1min"])
    fiveMinutes = float(received[PREFIX + "load/messages/received/5min"])
    fifteenMinutes = float(received[PREFIX + "load/messages/received/15min"])
    assert 1.99 <= oneMinute <= 2.0
    # The longer windows are still catching up, the longest the most.
    assert 1.7 < fiveMinutes < oneMinute
    assert 0.8 < fifteenMinutes < fiveMinutes


def test_wildcardFiltersDoNotSeeSysTopics():
    harness, _ = sysHarness()
    everything = harness.connect()
    subscribe(everything, b"#", b"1")
    subscribe(everything, b"+/broker/#", b"2")
    publisher = harness.connect()
    publisher.send(b"PUB 1 news 5\r\nhello\r\n")
    harness.clock.advance(INTERVAL)
    assert messages(everything.received()) == [(b"news", b"hello")]


def test_clientsCannotPublishOnSysTopics():
    harness, _ = sysHarness()
    client = harness.connect()
    # Someone subscribed by name, so to-matching would find the topic.
    subscribe(client, b"$SYS/broker/uptime")
    client.received()
    client.send(
        b"PUB 1 $SYS/broker/uptime 1\r\n0\r\n",
        b"PUB 2 $SYS/# 1 to-matching=1\r\n0\r\n",
    )
    written = client.received()
    assert written.count(b"BAD_TOPIC topics starting with '$' are reserved for the broker") == 2
    assert messages(written) == []


def test_stoppedPublisherPublishesNothing():
    harness, publisher = sysHarness()
    watcher = harness.connect()
    subscribe(watcher, b"$SYS/broker/uptime")
    watcher.received()
    publisher.stop()
    harness.clock.advance(10 * INTERVAL)
    assert values(watcher) == {}


def test_onlyValuesSomeoneSubscribesToAreMessages():
    """
    A round publishes, counts and logs only the values someone subscribes
    to; the others are only kept for the next subscriber.
    """
    harness, _ = sysHarness()
    assert harness.fields("publish") == []
    watcher = harness.connect()
    subscribe(watcher, b"$SYS/broker/uptime")
    harness.clock.advance(INTERVAL)
    [publish] = harness.fields("publish")
    assert (publish["topic"], publish["transport"], publish["subscribers"]) == (
        PREFIX + "uptime",
        "sys",
        1,
    )
    stats = harness.broker.stats()
    assert (stats["published"], stats["sys_published"]) == (1, 1)
    # messages/received counts what clients published: none.
    harness.clock.advance(INTERVAL)
    reader = harness.connect()
    subscribe(reader, b"$SYS/broker/messages/received")
    assert values(reader) == {PREFIX + "messages/received": "0"}


def test_aFailingRoundIsLogged():
    harness = BrokerHarness()
    publisher = SysPublisher(harness.broker, harness.clock, INTERVAL)
    logged = []
    publisher._log = Logger(observer=logged.append)

    def broken():
        raise RuntimeError("no stats today")

    harness.broker.stats = broken
    publisher.start()
    (event,) = logged
    assert event["log_format"] == "$SYS statistics stopped"
    assert event["log_failure"].check(RuntimeError)


@pytest.mark.e2e
def test_endToEnd(tmp_path):
    """
    A real broker's statistics reach C{dallal subscribe '$SYS/...'}, and
    never a subscriber to C{#}.
    """
    broker = BrokerProcess.plugin(tmp_path, "--sys-interval", "0.2")
    everything = watcher = None
    try:
        everything = subscriber(broker.port, "#")
        watcher = subscriber(
            broker.port, "$SYS/broker/clients/connected", "$SYS/broker/messages/received"
        )
        watcher.waitFor(rb"\$SYS/broker/clients/connected: 2\n")
        assert dallal("127.0.0.1", broker.port, "publish", "news", "hello").returncode == 0
        everything.waitFor(rb"news: hello\n")
        watcher.waitFor(rb"\$SYS/broker/messages/received: 1\n")
        assert b"$SYS" not in everything.output
    finally:
        for process in (everything, watcher):
            if process is not None:
                process.terminate()
        broker.stop()
