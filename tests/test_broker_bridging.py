"""
Bridging (L{dallal.broker.bridging}): a bridged message is routed the first
time this broker sees it, never back where it came from; loops, copies and
messages that crossed too many bridges are counted and discarded.
"""

import pytest
from helpers import RecordingSubscriber
from twisted.internet.task import Clock

from dallal.broker.core import Broker, BrokerConfig
from dallal.broker.origin import MAX_HOPS, Origin
from dallal.errors import BAD_ARGUMENTS, RequestError
from dallal.modes import FIRE


@pytest.fixture
def mesh():
    """
    A broker named C{here}, with two bridges attached and a local
    subscriber, all subscribed to C{news} in C{fire} mode.
    """
    broker = Broker(Clock(), BrokerConfig(name="here"))
    sessions = [RecordingSubscriber(f"127.0.0.1:{port}") for port in (1, 2, 3)]
    for number, subscriber in enumerate(sessions):
        broker.attach(subscriber)
        broker.subscribe(subscriber, "news", f"s{number}", FIRE, bridge=number < 2)
    return broker, sessions


def sentOrigin(broker="far", messageId="x.1", hops=0):
    return Origin(broker, messageId, hops)


def test_aBridgedMessageGoesEverywhereButWhereItCameFrom(mesh):
    broker, (bridge, other, local) = mesh
    message = broker.publishBridged(bridge, "news", b"m", sentOrigin(), "p")
    assert (bridge.takePayloads(), other.takePayloads(), local.takePayloads()) == (
        [],
        [b"m"],
        [b"m"],
    )
    assert broker.originOf(message) == Origin("far", "x.1", 1)
    assert broker.counters["bridged_published"] == 1


@pytest.mark.parametrize(
    "sent, counter",
    [
        (sentOrigin("here"), "bridged_duplicates"),
        (sentOrigin(hops=MAX_HOPS), "bridged_hop_limit"),
    ],
    ids=["loop", "hop_limit"],
)
def test_aLoopOrATooLongPathIsDiscarded(mesh, sent, counter):
    broker, (bridge, other, local) = mesh
    assert broker.publishBridged(bridge, "news", b"m", sent, "p") is None
    assert (other.takePayloads(), local.takePayloads()) == ([], [])
    assert (broker.counters[counter], broker.counters["published"]) == (1, 0)


def test_aCopyByAnotherPathIsDiscarded(mesh):
    broker, (bridge, other, local) = mesh
    broker.publishBridged(bridge, "news", b"m", sentOrigin(hops=1), "p")
    assert broker.publishBridged(other, "news", b"m", sentOrigin(hops=2), "q") is None
    assert local.takePayloads() == [b"m"]
    assert (broker.counters["bridged_duplicates"], broker.counters["published"]) == (1, 1)


@pytest.mark.parametrize(
    "sent",
    [
        Origin("", "x.1", 0),
        Origin("le/af", "x.1", 0),
        Origin("far", "", 0),
        Origin("far", "x.1", None),
    ],
    ids=["no_broker", "bad_broker", "no_id", "hops_no_number"],
)
def test_aBadOriginIsRefusedAndCounted(mesh, sent):
    broker, (bridge, _, _) = mesh
    with pytest.raises(RequestError) as refused:
        broker.publishBridged(bridge, "news", b"m", sent, "p")
    assert refused.value.code == BAD_ARGUMENTS
    assert (broker.counters["bridged_refused"], broker.counters["published"]) == (1, 0)


def test_aMessagePublishedHereCarriesThisBrokersOrigin(mesh):
    broker, (_, _, local) = mesh
    message = broker.publish(local, "news", b"m", "p")
    assert broker.originOf(message) == Origin(
        "here", f"{broker.bridging.incarnation}.{message.mid}", 0
    )
