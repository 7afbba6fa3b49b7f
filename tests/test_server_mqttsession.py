"""
MQTT sessions that outlive their connections (L{dallal.server.mqttsession}):
Clean Session 0, MQTT 5's Session Expiry Interval, will delay, and their
bounds, on in-memory connections and a clock.
"""

import sqlite3

import pytest
import pytest_twisted
from helpers import STOP_TIMEOUT, BrokerHarness, countersAddUp, harnessWithRetained
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_events_catalogue import MQTT_SESSION_EVENTS, catalogue
from test_server_mqtt import MQTTClient, _packets, connected
from twisted.internet import reactor
from twisted.internet.defer import fail, maybeDeferred

from dallal.broker.core import BrokerConfig
from dallal.broker.delivery import DeliveryConfig
from dallal.broker.retained import StoreError
from dallal.protocol.mqtt import (
    MQTT_5,
    Disconnect,
    Property,
    PubAck,
    Publish,
    PubRec,
    PubRel,
    ReasonCode,
    Subscription,
    Will,
)
from dallal.server.mqttstore import FILE_NAME, SessionStore
from dallal.server.tap import Options, makeService


@pytest.fixture
def harness():
    return harnessWithRetained()


def away(harness, clientId="s", version=MQTT_5, qos=1, topicFilter="t", **fields):
    """
    A client that subscribed to C{topicFilter} in a session that outlives
    its connection, then lost its connection.
    """
    if version == MQTT_5:
        fields.setdefault("properties", {Property.SESSION_EXPIRY_INTERVAL: 3600})
    client = connected(harness, clientId, version, cleanStart=False, **fields)
    client.subscribe((topicFilter, qos))
    client.lose()
    return client


def resumed(harness, clientId="s", version=MQTT_5, **fields):
    """
    A new connection of C{clientId} resuming its session: its CONNACK and
    what follows it.
    """
    client = MQTTClient(harness, version)
    answer, *packets = client.connect(clientId, cleanStart=False, **fields)
    assert answer.reasonCode == 0
    return client, answer, packets


def keeping(harness, receiveMaximum):
    """
    An MQTT 5 client whose session outlives its connection by a minute.
    """
    properties = {Property.SESSION_EXPIRY_INTERVAL: 60, Property.RECEIVE_MAXIMUM: receiveMaximum}
    return connected(harness, "s", MQTT_5, cleanStart=False, properties=properties)


@pytest.mark.parametrize("version", [4, MQTT_5])
def test_qos1MessagesWaitForAClientThatIsAway(harness, version):
    away(harness, version=version)
    publisher = connected(harness, "p")
    publisher.send(
        Publish("t", b"one", qos=1, packetId=1),
        Publish("t", b"zero", qos=0),
        Publish("t", b"two", qos=1, packetId=2),
    )
    client, answer, packets = resumed(harness, version=version)
    assert answer.sessionPresent
    # QoS 0 is not kept for a client that is away, as Mosquitto does.
    assert [(p.payload, p.qos, p.dup) for p in packets] == [(b"one", 1, False), (b"two", 1, False)]
    client.send(*(PubAck(p.packetId) for p in packets))
    (event,) = harness.fields("session_resumed")
    assert event["client_id"] == "s" and event["queued"] == 2
    harness.clock.advance(0)
    counters = harness.broker.stats()
    assert counters["dropped_disconnected"] == 1 and counters["inflight"] == 0
    assert countersAddUp(counters)
    # The subscription is the session's: new messages come.
    publisher.send(Publish("t", b"three", qos=1, packetId=3))
    assert [p.payload for p in client.received()] == [b"three"]


def test_whatWasSentAndNotAckedIsSentAgainWithDup(harness):
    client = connected(harness, "s", cleanStart=False)
    client.subscribe(("a", 1), ("b", 2))
    publisher = connected(harness, "p")
    publisher.send(Publish("a", b"one", qos=1, packetId=1), Publish("b", b"two", qos=2, packetId=2))
    publisher.send(PubRel(2))
    one, two = client.received()
    client.send(PubRec(two.packetId))
    assert client.received() == [PubRel(two.packetId)]
    client.lose()
    client, answer, packets = resumed(harness, version=4)
    assert answer.sessionPresent
    # [MQTT-4.4.0-1]: the PUBLISH with DUP, and the PUBREL.
    assert packets == [
        Publish("a", b"one", qos=1, dup=True, packetId=one.packetId),
        PubRel(two.packetId),
    ]


def test_aConnectionTakesAConnectedSessionOver(harness):
    first = connected(harness, "s", cleanStart=False)
    first.subscribe(("t", 1))
    publisher = connected(harness, "p")
    publisher.send(Publish("t", b"x", qos=1, packetId=1))
    (sent,) = first.received()
    second, answer, packets = resumed(harness, version=4)
    assert first.closing and answer.sessionPresent
    assert packets == [Publish("t", b"x", qos=1, dup=True, packetId=sent.packetId)]
    first.lose()
    publisher.send(Publish("t", b"y", qos=1, packetId=2))
    assert [p.payload for p in second.received()] == [b"y"]


def test_aCleanStartEndsTheSession(harness):
    away(harness)
    connected(harness, "p").send(Publish("t", b"x", qos=1, packetId=1))
    client = MQTTClient(harness, MQTT_5)
    (answer,) = client.connect("s", cleanStart=True)
    assert not answer.sessionPresent
    connected(harness, "p2").send(Publish("t", b"y", qos=1, packetId=1))
    assert client.received() == []
    assert harness.broker.stats()["dropped_disconnected"] == 1


def test_aSessionWithoutExpiryEndsWithItsConnection(harness):
    client = connected(harness, "s", MQTT_5, cleanStart=False)
    client.subscribe(("t", 1))
    client.lose()
    _, answer, _ = resumed(harness)
    assert not answer.sessionPresent


def test_theSessionExpiresAfterItsInterval(harness):
    away(harness, properties={Property.SESSION_EXPIRY_INTERVAL: 10})
    connected(harness, "p").send(Publish("t", b"x", qos=1, packetId=1))
    harness.clock.advance(9)
    assert harness.fields("session_expired") == []
    harness.clock.advance(1)
    (event,) = harness.fields("session_expired")
    assert event["client_id"] == "s" and event["queued"] == 1
    _, answer, packets = resumed(harness)
    assert not answer.sessionPresent and packets == []
    assert harness.broker.stats()["dropped_disconnected"] == 1


def test_theDisconnectCanChangeTheExpiry(harness):
    client = connected(
        harness, "s", MQTT_5, cleanStart=False, properties={Property.SESSION_EXPIRY_INTERVAL: 10}
    )
    client.send(Disconnect(properties={Property.SESSION_EXPIRY_INTERVAL: 0}))
    client.lose()
    _, answer, _ = resumed(harness)
    assert not answer.sessionPresent


def test_aDisconnectCannotGiveAnExpiryToASessionWithout(harness):
    client = connected(harness, "s", MQTT_5)
    client.send(Disconnect(properties={Property.SESSION_EXPIRY_INTERVAL: 10}))
    (answer,) = client.received()
    assert answer.reasonCode == ReasonCode.PROTOCOL_ERROR and client.closing


def test_anOfflineQueueHasTheBoundsOfAConnectedOne():
    """
    What waits for a client that is away meets the same queue limits, and
    holds no publisher back: the core sends the session all it has, and
    over --max-queued the newest are dropped, as Mosquitto drops them.
    """
    delivery = DeliveryConfig(maxQueued=2)
    harness = BrokerHarness(BrokerConfig(delivery=delivery))
    away(harness, properties={Property.SESSION_EXPIRY_INTERVAL: 60, Property.RECEIVE_MAXIMUM: 1})
    publisher = connected(harness, "p")
    for number in range(6):
        publisher.send(Publish("t", b"%d" % number, qos=1, packetId=number + 1))
    assert [type(p) for p in publisher.received()] == [PubAck] * 6
    harness.clock.advance(0)
    counters = harness.broker.stats()
    assert counters["dropped_queue_full"] == counters["refused_queued_messages"] == 4
    assert counters["publishers_held"] == 0
    client, _, packets = resumed(harness)
    received = [p.payload for p in packets]
    while packets:
        client.send(*(PubAck(p.packetId) for p in packets))
        packets = client.received()
        received += [p.payload for p in packets]
    assert received == [b"0", b"1"]
    assert countersAddUp(harness.broker.stats())


def test_whatOfflineSessionsHoldTogetherIsBounded(harness):
    """
    The payload bytes all sessions whose clients are away hold together
    are bounded by --max-offline-bytes, however many they are: a message
    for one more is dropped, counted and logged; a session that resumes
    frees what it held.
    """
    harness.service.mqttFactory.maxOfflineBytes = 10
    away(harness, "a", topicFilter="a")
    away(harness, "b", topicFilter="b")
    publisher = connected(harness, "p")
    for number, topic in enumerate(["a", "b", "a", "b"]):
        publisher.send(Publish(topic, b"4444", qos=1, packetId=number + 1))
    harness.clock.advance(0)
    counters = harness.broker.stats()
    assert counters["refused_offline_bytes"] == counters["dropped_queue_full"] == 2
    (event,) = harness.fields("limit_reached")
    assert event["limit"] == "offline_bytes" and event["max"] == 10
    assert [p.payload for p in resumed(harness, "a")[2]] == [b"4444"]
    publisher.send(Publish("b", b"4444", qos=1, packetId=9))
    assert [p.payload for p in resumed(harness, "b")[2]] == [b"4444", b"4444"]
    assert harness.service.mqttFactory.offlineBytes == 0
    assert countersAddUp(harness.broker.stats())


def test_offlineSessionsAreBounded(harness):
    harness.service.mqttFactory.maxOfflineSessions = 1
    away(harness, "a")
    away(harness, "b")
    assert harness.broker.stats()["refused_offline_sessions"] == 1
    (event,) = harness.fields("limit_reached")
    assert event["limit"] == "offline_sessions" and event["max"] == 1
    assert resumed(harness, "a")[1].sessionPresent
    assert not resumed(harness, "b")[1].sessionPresent


# Will delay


def watcher(harness):
    client = connected(harness, "w")
    client.subscribe(("status", 0))
    return client


def dying(harness, delay, expiry, clientId="d"):
    client = connected(
        harness,
        clientId,
        MQTT_5,
        cleanStart=False,
        properties={Property.SESSION_EXPIRY_INTERVAL: expiry},
        will=Will("status", b"gone", properties={Property.WILL_DELAY_INTERVAL: delay}),
    )
    client.lose()


def test_theWillWaitsForItsDelay(harness):
    watching = watcher(harness)
    dying(harness, 5, 60)
    harness.clock.advance(4.9)
    assert watching.received() == []
    harness.clock.advance(0.1)
    assert [p.payload for p in watching.received()] == [b"gone"]


def test_aReconnectionWithinTheDelayCancelsTheWill(harness):
    watching = watcher(harness)
    dying(harness, 5, 60)
    harness.clock.advance(4)
    resumed(harness, "d")
    harness.clock.advance(10)
    assert watching.received() == []


def test_aWillKeptForItsDelayCountsInWhatOfflineSessionsHold(harness):
    """
    A will waiting for its delay is held as the messages are, within
    --max-offline-bytes: a session whose will would take more ends with its
    connection, its will published then, as one over --max-offline-sessions.
    """
    factory = harness.service.mqttFactory
    factory.maxOfflineBytes = 6
    watching = watcher(harness)
    dying(harness, 60, 3600, "d1")
    assert factory.offlineBytes == 4 and watching.received() == []
    dying(harness, 60, 3600, "d2")
    assert [p.payload for p in watching.received()] == [b"gone"]
    assert harness.broker.stats()["refused_offline_bytes"] == 1
    assert not resumed(harness, "d2")[1].sessionPresent
    harness.clock.advance(60)
    assert [p.payload for p in watching.received()] == [b"gone"]
    assert factory.offlineBytes == 0


def test_theWillGoesWhenTheSessionEndsIfSooner(harness):
    watching = watcher(harness)
    dying(harness, 30, 5)
    harness.clock.advance(5)
    assert [p.payload for p in watching.received()] == [b"gone"]


def test_aCleanStartWithinTheDelayPublishesTheWill(harness):
    watching = watcher(harness)
    dying(harness, 30, 60)
    MQTTClient(harness, MQTT_5).connect("d", cleanStart=True)
    assert [p.payload for p in watching.received()] == [b"gone"]


def test_aWillWithoutDelayGoesAtOnceEvenIfTheSessionStays(harness):
    watching = watcher(harness)
    dying(harness, 0, 60)
    assert [p.payload for p in watching.received()] == [b"gone"]


# Across restarts


def inline(function, *arguments):
    return maybeDeferred(function, *arguments)


def storedIn(path, now=1000.0):
    return SessionStore(str(path / FILE_NAME), runInThread=inline, clock=lambda: now)


def stopped(harness):
    result = []
    harness.service.stopService().addBoth(result.append)
    harness.clock.advance(harness.service.shutdownGrace)
    assert result, "the service did not stop"


def restarted(store):
    harness = BrokerHarness()
    factory = harness.service.mqttFactory
    factory.store = store
    factory.restoreSessions()
    return harness


def test_sessionsSurviveARestart(tmp_path):
    harness = BrokerHarness()
    harness.service.mqttFactory.store = storedIn(tmp_path)
    client = keeping(harness, 1)
    client.subscribe(Subscription("t", 2, retainAsPublished=True), ("u/+", 1))
    publisher = connected(harness, "p", MQTT_5)
    publisher.send(
        Publish("t", b"one", qos=2, packetId=1, properties={Property.CONTENT_TYPE: "a/b"}),
        Publish("u/1", b"two", qos=1, packetId=2),
        Publish("u/2", b"three", qos=1, packetId=3),
    )
    (sent,) = [p for p in client.received() if isinstance(p, Publish)]
    client.lose()
    stopped(harness)
    (event,) = harness.fields("sessions_saved")
    assert event["count"] == 1

    harness = restarted(storedIn(tmp_path, now=1030.0))
    (event,) = harness.fields("sessions_restored")
    assert event["count"] == 1
    client, answer, packets = resumed(harness, properties={Property.RECEIVE_MAXIMUM: 10})
    assert answer.sessionPresent
    assert packets == [
        Publish(
            "t",
            b"one",
            2,
            dup=True,
            packetId=sent.packetId,
            properties={Property.CONTENT_TYPE: "a/b"},
        ),
        Publish("u/1", b"two", 1, packetId=packets[1].packetId),
        Publish("u/2", b"three", 1, packetId=packets[2].packetId),
    ]
    # The subscriptions came back too.
    connected(harness, "p").send(Publish("u/3", b"four", qos=1, packetId=1))
    assert [p.payload for p in client.received()] == [b"four"]


def test_aSessionThatExpiredWhileTheBrokerWasStoppedIsGone(tmp_path):
    harness = BrokerHarness()
    harness.service.mqttFactory.store = storedIn(tmp_path)
    away(harness, properties={Property.SESSION_EXPIRY_INTERVAL: 60})
    harness.clock.advance(10)
    stopped(harness)
    # 50 seconds were left.
    harness = restarted(storedIn(tmp_path, now=1000.0 + 49))
    assert resumed(harness)[1].sessionPresent
    harness = restarted(storedIn(tmp_path, now=1000.0 + 50))
    assert not resumed(harness)[1].sessionPresent


def diedBeforeAStop(tmp_path, delay, expiry, wait=0):
    """
    A broker with a store, a client with a delayed will lost C{wait}
    seconds before the broker stops (at 1000 on the store's clock).
    """
    harness = BrokerHarness()
    harness.service.mqttFactory.store = storedIn(tmp_path)
    dying(harness, delay, expiry)
    harness.clock.advance(wait)
    stopped(harness)
    assert harness.fields("publish") == []


def restartedWithWatcher(tmp_path, now):
    harness = restarted(storedIn(tmp_path, now=now))
    return harness, watcher(harness)


def test_aWillWaitingForItsDelayOutlivesARestart(tmp_path):
    """
    A will whose delay had not passed when the broker stopped goes out
    when the time it had left is over, unless its client is back first.
    """
    diedBeforeAStop(tmp_path, 30, 3600, wait=10)
    # 20 seconds were left; 5 went by while the broker was stopped.
    harness, watching = restartedWithWatcher(tmp_path, now=1005.0)
    harness.clock.advance(14.9)
    assert watching.received() == []
    harness.clock.advance(0.1)
    assert [p.payload for p in watching.received()] == [b"gone"]
    assert harness.service.mqttFactory.offlineBytes == 0

    harness, watching = restartedWithWatcher(tmp_path, now=1005.0)
    harness.clock.advance(10)
    assert resumed(harness, "d")[1].sessionPresent
    harness.clock.advance(60)
    assert watching.received() == []


def test_aWillWhoseDelayPassedWhileTheBrokerWasStoppedGoesAtOnce(tmp_path):
    diedBeforeAStop(tmp_path, 30, 3600)
    harness, watching = restartedWithWatcher(tmp_path, now=1031.0)
    harness.clock.advance(0)
    assert [p.payload for p in watching.received()] == [b"gone"]
    assert resumed(harness, "d")[1].sessionPresent


def test_aWillDueAtTheSessionsEndOutlivesARestart(tmp_path):
    """
    A will whose delay is longer than its session's expiry goes out when
    the session expires, after the restart, or at once if it expired
    while the broker was stopped.
    """
    diedBeforeAStop(tmp_path, 3600, 60)
    harness, watching = restartedWithWatcher(tmp_path, now=1030.0)
    harness.clock.advance(29)
    assert watching.received() == []
    harness.clock.advance(1)
    assert [p.payload for p in watching.received()] == [b"gone"]

    harness, watching = restartedWithWatcher(tmp_path, now=1060.0)
    harness.clock.advance(0)
    assert [p.payload for p in watching.received()] == [b"gone"]
    assert not resumed(harness, "d")[1].sessionPresent


def test_aConnectedClientsWillIsNotKept(tmp_path):
    harness = BrokerHarness()
    harness.service.mqttFactory.store = storedIn(tmp_path)
    connected(
        harness,
        "d",
        MQTT_5,
        cleanStart=False,
        properties={Property.SESSION_EXPIRY_INTERVAL: 60},
        will=Will("status", b"gone", properties={Property.WILL_DELAY_INTERVAL: 5}),
    )
    stopped(harness)
    harness, watching = restartedWithWatcher(tmp_path, now=1000.0)
    harness.clock.advance(60)
    assert watching.received() == []


def test_aStoreWrittenWithoutWillsIsRead(tmp_path):
    """
    A store whose schema has no table of wills yet (written before they
    were kept) is read, and gains the table when it is next written.
    """
    harness = BrokerHarness()
    harness.service.mqttFactory.store = storedIn(tmp_path)
    away(harness)
    stopped(harness)
    path = tmp_path / FILE_NAME
    sqlite3.connect(path, isolation_level=None).execute("DROP TABLE wills")
    harness = restarted(storedIn(tmp_path))
    stopped(harness)
    harness = restarted(storedIn(tmp_path))
    assert resumed(harness)[1].sessionPresent


def test_aStoreNeverWrittenToHoldsNoSession(tmp_path):
    sqlite3.connect(tmp_path / FILE_NAME).execute("CREATE TABLE unfinished (x)")
    assert storedIn(tmp_path).load() == []


def test_aStoreOfAnotherVersionIsRefused(tmp_path):
    path = tmp_path / FILE_NAME
    sqlite3.connect(path).execute("PRAGMA user_version = 7")
    with pytest.raises(StoreError) as error:
        storedIn(tmp_path).load()
    assert "schema version 7" in str(error.value)


def test_theSessionEventsCarryTheCataloguedFields(tmp_path):
    harness = BrokerHarness()
    harness.service.mqttFactory.store = storedIn(tmp_path)
    away(harness, "a")
    resumed(harness, "a")[0].lose()
    away(harness, "b", properties={Property.SESSION_EXPIRY_INTERVAL: 1})
    harness.clock.advance(1)
    stopped(harness)
    failing = BrokerHarness()
    failing.service.mqttFactory.store = SessionStore(
        str(tmp_path / "x"), runInThread=lambda *_: fail(StoreError("the disk is full"))
    )
    away(failing, "c")
    stopped(failing)
    restored = restarted(storedIn(tmp_path))
    events, _ = catalogue()
    for name in MQTT_SESSION_EVENTS:
        (emitted,) = [h.fields(name)[0] for h in (harness, failing, restored) if h.fields(name)]
        assert list(emitted) == events[name][1], name
    assert failing.fields("sessions_not_saved")[0]["error"] == "the disk is full"


@pytest_twisted.ensureDeferred
async def test_theOptionsReachTheFactory(tmp_path):
    options = Options()
    options.parseOptions(
        ["--data-dir", str(tmp_path), "--max-offline-sessions", "7", "--max-offline-bytes", "9"]
    )
    service = makeService(options, reactor)
    await service.broker.retained.close().addTimeout(STOP_TIMEOUT, reactor)
    factory = service.mqttFactory
    assert factory.maxOfflineSessions == 7
    assert factory.maxOfflineBytes == 9
    assert factory.store.path == str(tmp_path / FILE_NAME)


@pytest.mark.parametrize("kept", [True, False])
def test_aStoppingBrokerDoesNotWaitForClientsThatAreAway(tmp_path, kept):
    harness = BrokerHarness()
    if kept:
        harness.service.mqttFactory.store = storedIn(tmp_path)
    away(harness)
    connected(harness, "p").send(Publish("t", b"x", qos=1, packetId=1))
    result = []
    harness.service.stopService().addBoth(result.append)
    harness.clock.advance(0.1)
    assert result, "the broker waited for a client that is away"
    (stats,) = harness.fields("stats")
    assert (stats["acked" if kept else "dropped_disconnected"], stats["inflight"]) == (1, 0)


def test_aResumingConnectionGetsWhatAFullOneHeldBack(harness):
    first = connected(harness, "s", cleanStart=False)
    first.subscribe(("t", 1))
    first.connection.protocol.outputFull()
    publisher = connected(harness, "p")
    publisher.send(Publish("t", b"x", qos=1, packetId=1))
    assert first.received() == []
    second, answer, packets = resumed(harness, version=4)
    assert [p.payload for p in packets] == [b"x"]


def test_whatIsSentAgainKeepsWithinTheNewReceiveMaximum(harness):
    client = keeping(harness, 3)
    client.subscribe(("t", 1))
    publisher = connected(harness, "p")
    for number in range(3):
        publisher.send(Publish("t", b"%d" % number, qos=1, packetId=number + 1))
    assert len(client.received()) == 3
    client.lose()
    client, _, packets = resumed(harness, properties={Property.RECEIVE_MAXIMUM: 1})
    received = []
    while packets:
        (packet,) = packets
        assert packet.dup
        received.append(packet.payload)
        client.send(PubAck(packet.packetId))
        packets = client.received()
    assert received == [b"0", b"1", b"2"]


def test_aResumedSessionTakesTheReceiveMaximumOfItsNewConnection(harness):
    """
    The core sends a session as much at a time as the Receive Maximum of
    the connection that carries it now, not of the one that began it.
    """
    client = keeping(harness, 1)
    client.subscribe(("t", 1))
    client.lose()
    publisher = connected(harness, "p")
    for number in range(2):
        publisher.send(Publish("t", b"away %d" % number, qos=1, packetId=number + 1))
    client, _, packets = resumed(harness, properties={Property.RECEIVE_MAXIMUM: 5})
    assert [p.payload for p in packets] == [b"away 0", b"away 1"]
    for number in range(4):
        publisher.send(Publish("t", b"back %d" % number, qos=1, packetId=number + 3))
    assert [p.payload for p in client.received()] == [b"back 0", b"back 1", b"back 2"]


_RECONNECT, _TICK = "reconnect", "tick"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(st.one_of(_packets, st.sampled_from([_RECONNECT, _TICK])), max_size=25),
    receiveMaximum=st.integers(1, 3),
)
def test_anySequenceWithReconnectionsKeepsTheCountersTrue(steps, receiveMaximum):
    """
    A client whose session outlives its connections, lost and back again
    (with a Receive Maximum of its own each time) among any packets: no
    exception escapes, and once its session expired the broker's
    accounting adds up with nothing left in flight.
    """
    harness = BrokerHarness(BrokerConfig(messageEvents=False))
    properties = {Property.SESSION_EXPIRY_INTERVAL: 5, Property.RECEIVE_MAXIMUM: receiveMaximum}
    keeper = connected(harness, "keeper", MQTT_5, cleanStart=False, properties=properties)
    keeper.subscribe(("#", 2))
    other = connected(harness, "other", MQTT_5)
    for number, step in enumerate(steps):
        if step == _RECONNECT:
            keeper.lose()
            properties[Property.RECEIVE_MAXIMUM] = number % 3 + 1
            keeper = MQTTClient(harness, MQTT_5)
            keeper.connect("keeper", cleanStart=False, properties=properties)
        elif step == _TICK:
            harness.clock.advance(1)
        else:
            client = (keeper, other)[number % 2]
            if not client.closing:
                client.send(step)
    keeper.lose()
    other.lose()
    harness.clock.advance(5)
    harness.clock.advance(0)
    counters = harness.broker.counters
    assert countersAddUp(counters)
    assert counters["inflight"] == 0 and counters["connections"] == 0


def test_aRestoredSessionReadsWhatItsUserMay(tmp_path):
    """
    A session taken up from the store is its user's again: the ACL
    applies to what it is sent while its client is away.
    """
    acl = "user alice\ntopic readwrite news/#\nuser bob\ntopic read news/public\n"

    def broker():
        return BrokerHarness(users={"alice": b"pw", "bob": b"pw"}, acl=acl)

    harness = broker()
    harness.service.mqttFactory.store = storedIn(tmp_path)
    away(harness, version=4, topicFilter="news/#", username="bob", password=b"pw")
    stopped(harness)
    harness = broker()
    factory = harness.service.mqttFactory
    factory.store = storedIn(tmp_path)
    factory.restoreSessions()
    publisher = connected(harness, "p", username="alice", password=b"pw")
    publisher.send(
        Publish("news/secret", b"no", qos=1, packetId=1),
        Publish("news/public", b"yes", qos=1, packetId=2),
    )
    client, answer, packets = resumed(harness, version=4, username="bob", password=b"pw")
    assert answer.sessionPresent
    assert [p.payload for p in packets] == [b"yes"]
