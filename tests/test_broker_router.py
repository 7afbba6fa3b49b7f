"""
The router (L{dallal.broker.router}): which subscriptions a message goes
to, and the one path that makes and counts every published message.
"""

from helpers import RecordingSubscriber
from twisted.internet.task import Clock

from dallal.broker.core import Broker, BrokerConfig
from dallal.broker.origin import Origin
from dallal.modes import ALL, FIRE, LATEST
from dallal.security.acl import parseAcl
from dallal.security.auth import BrokerUser


def brokerWith(*peers, **config):
    """
    A broker on a clock, and a L{RecordingSubscriber} attached to it for
    each of C{peers}.
    """
    broker = Broker(Clock(), BrokerConfig(**config))
    subscribers = [RecordingSubscriber(peer) for peer in peers]
    for subscriber in subscribers:
        broker.attach(subscriber)
    return broker, subscribers


def published(broker):
    return {name: broker.counters[name] for name in ("published", "bytes_in")}


def test_everyWayOfPublishingCountsEachMessageOnce():
    """
    A client's publish, a publish to every matching topic, a bridged
    message and a value of the broker's own topics are each counted once
    as published, with their bytes, whatever reaches them.
    """
    broker, (publisher, reader) = brokerWith("127.0.0.1:1", "127.0.0.1:2")
    broker.subscribe(reader, "a", "s1", FIRE)
    broker.subscribe(reader, "b", "s2", FIRE)
    broker.subscribe(reader, "$SYS/#", "s3", FIRE)
    broker.publish(publisher, "a", b"12", "p1")
    assert published(broker) == {"published": 1, "bytes_in": 2}
    assert broker.publishToMatching(publisher, "+", b"345", "p2") == 2
    assert published(broker) == {"published": 3, "bytes_in": 8}
    sent = Origin("far", "x.1", 0)
    broker.publishBridged(publisher, "a", b"6789", sent, "p3")
    assert published(broker) == {"published": 4, "bytes_in": 12}
    broker.publishOwn("$SYS/broker/x", b"0")
    assert published(broker) == {"published": 5, "bytes_in": 13}
    assert (broker.counters["bridged_published"], broker.counters["sys_published"]) == (1, 1)
    assert reader.takePayloads() == [b"12", b"345", b"345", b"6789", b"0"]


def test_aSessionGetsAMessageOnceThroughItsStrongestFilter():
    """
    Two filters of one session match: the message goes once, through the
    subscription whose mode promises the most (C{all} over C{latest} over
    C{fire}).
    """
    broker, (publisher, reader) = brokerWith("127.0.0.1:1", "127.0.0.1:2")
    broker.subscribe(reader, "news/#", "fire", FIRE)
    broker.subscribe(reader, "news/+", "all", ALL)
    broker.subscribe(reader, "news/a", "latest", LATEST)
    broker.publish(publisher, "news/a", b"m", "p")
    assert [sent.sub for sent in reader.take()] == ["all"]
    assert broker.counters["matched"] == 1


def test_aRouteFollowsTheSubscriptions():
    """
    A topic's route is remembered, and forgotten when a subscription is
    made, changed or ended.
    """
    broker, (publisher, reader) = brokerWith("127.0.0.1:1", "127.0.0.1:2")
    broker.publish(publisher, "news", b"nobody", "p")
    broker.subscribe(reader, "news", "s", FIRE)
    broker.publish(publisher, "news", b"one", "p")
    broker.subscribe(reader, "#", "t", ALL)
    broker.publish(publisher, "news", b"two", "p")
    broker.unsubscribe(reader, "#", "u")
    broker.publish(publisher, "news", b"three", "p")
    broker.unsubscribe(reader, "news", "v")
    broker.publish(publisher, "news", b"gone", "p")
    assert [(sent.payload, sent.sub) for sent in reader.take()] == [
        (b"one", "s"),
        (b"two", "t"),
        (b"three", "s"),
    ]


def test_aSessionGetsOnlyWhatTheAclLetsItRead():
    broker, (publisher, reader) = brokerWith("127.0.0.1:1", "127.0.0.1:2")
    permissions = parseAcl("topic read news/public\n").permissionsFor(None, None)
    broker.login(reader, BrokerUser(None, permissions))
    broker.subscribe(reader, "news/+", "s", FIRE)
    broker.publish(publisher, "news/secret", b"no", "p")
    broker.publish(publisher, "news/public", b"yes", "p")
    assert reader.takePayloads() == [b"yes"]


def test_publishedAndRetainedMessagesHaveDistinctIds():
    """
    A message offered as retained takes an id of the same sequence as the
    published ones.
    """
    broker, (publisher, reader) = brokerWith("127.0.0.1:1", "127.0.0.1:2")
    first = broker.publish(publisher, "a", b"1", "p")
    broker.publishOwn("$SYS/x", b"kept")
    subscription = broker.subscribe(reader, "$SYS/x", "s", FIRE)
    broker.sendRetained(reader, subscription)
    second = broker.publish(publisher, "a", b"2", "p")
    assert reader.takePayloads() == [b"kept"]
    assert (first.mid, second.mid) == (1, 3)
