"""
Filters, retained messages, UNSUB, LIST, TOPICS and publishes to every
matching topic, through the broker's TCP protocol on a clock (PROTOCOL.md,
"Topics and filters" and "Retained messages").
"""

import json

from helpers import BrokerHarness, decodeFrames, harnessWithRetained


def messages(client):
    """
    C{(topic, payload, options)} of each MSG written to the client since the
    last call.
    """
    return messagesIn(client.received())


def messagesIn(written):
    """
    C{(topic, payload, options)} of each MSG in C{written}.
    """
    return [
        (
            frame.arguments[0].decode(),
            frame.payload,
            dict(argument.split(b"=", 1) for argument in frame.arguments if b"=" in argument),
        )
        for frame in decodeFrames(written)
        if frame.verb == b"MSG"
    ]


def document(written, verb):
    """
    The JSON payload of the one C{<verb> <id> <size>} answer in C{written},
    the bytes a client received.
    """
    start = written.index(verb + b" ")
    header, rest = written[start:].split(b"\r\n", 1)
    size = int(header.split(b" ")[2])
    return json.loads(rest[:size])


def publish(client, topic, payload, options=b""):
    client.send(b"PUB p %s %d%s\r\n%s\r\n" % (topic, len(payload), options, payload))


def test_wildcardSubscriptionsFollowTheRules():
    harness = BrokerHarness()
    subscriber, publisher = harness.connect(), harness.connect()
    subscriber.send(b"SUB 1 a/+ mode=fire\r\nSUB 2 b/# mode=fire\r\n")
    subscriber.received()
    for topic in (b"a/x", b"a/x/y", b"a", b"b", b"b/c/d", b"c"):
        publish(publisher, topic, b"m")
    assert [topic for topic, _, _ in messages(subscriber)] == ["a/x", "b", "b/c/d"]


def test_overlappingFiltersDeliverOnceThroughTheStrongestMode():
    """
    Two filters of one connection matching a message: it arrives once, with
    the sub= of the subscription whose mode promises the most.
    """
    harness = BrokerHarness()
    subscriber, publisher = harness.connect(), harness.connect()
    subscriber.send(b"SUB f a/# mode=fire\r\nSUB k a/+ mode=all\r\n")
    subscriber.received()
    publish(publisher, b"a/b", b"once")
    ((topic, payload, options),) = messages(subscriber)
    assert (topic, payload, options[b"sub"]) == ("a/b", b"once", b"k")


def test_routesFollowSubscriptionChanges():
    """
    The broker remembers where a topic's messages go, and forgets it when
    the subscriptions change: a new subscriber, a new mode, an UNSUB and a
    connection that leaves each change who gets the next message, and how.
    """
    harness = BrokerHarness()
    first, second, publisher = harness.connect(), harness.connect(), harness.connect()
    first.send(b"SUB f a/# mode=fire\r\n")
    publish(publisher, b"a/b", b"1")
    second.send(b"SUB s a/b mode=fire\r\n")
    publish(publisher, b"a/b", b"2")
    first.send(b"SUB k a/+ mode=all\r\n")
    publish(publisher, b"a/b", b"3")
    first.send(b"SUB k a/+ mode=fire\r\nSUB f a/# mode=latest\r\n")
    publish(publisher, b"a/b", b"4")
    first.send(b"UNSUB u a/#\r\n")
    publish(publisher, b"a/b", b"5")
    second.lose()
    publish(publisher, b"a/b", b"6")
    assert [(payload, options[b"sub"]) for _, payload, options in messages(first)] == [
        (b"1", b"f"),
        (b"2", b"f"),
        (b"3", b"k"),
        (b"4", b"f"),
        (b"5", b"k"),
        (b"6", b"k"),
    ]
    assert [payload for _, payload, _ in messages(second)] == [b"2", b"3", b"4", b"5"]
    assert [event["subscribers"] for event in harness.fields("publish")] == [1, 2, 2, 2, 2, 1]


def test_aTopicRefusedOnceIsRefusedAgain():
    """
    Valid topics are remembered, refused ones are not taken for valid.
    """
    client = BrokerHarness().connect()
    for _ in range(2):
        publish(client, b"ok", b"x")
        publish(client, b"+bad", b"x")
    assert client.received().count(b"ERR p BAD_TOPIC ") == 2


def test_retainedMessagesReachNewSubscriptionsAfterTheirSubAck():
    harness = harnessWithRetained()
    publisher = harness.connect()
    publish(publisher, b"w/a", b"sunny", b" retain=1")
    publish(publisher, b"w/b", b"rain", b" retain=1")
    publish(publisher, b"w/b", b"snow", b" retain=1")
    assert publisher.received() == b"PUBACK p\r\n" * 3
    subscriber = harness.connect()
    subscriber.send(b"SUB 1 w/# mode=fire\r\n")
    written = subscriber.received()
    assert written.startswith(b"SUBACK 1\r\n")
    received = messagesIn(written)
    assert sorted((topic, payload) for topic, payload, _ in received) == [
        ("w/a", b"sunny"),
        ("w/b", b"snow"),
    ]
    assert all(options[b"retained"] == b"1" for _, _, options in received)


def test_anEmptyRetainedPublishClearsTheTopic():
    harness = harnessWithRetained()
    publisher = harness.connect()
    publish(publisher, b"w/a", b"sunny", b" retain=1")
    publish(publisher, b"w/a", b"", b" retain=1")
    subscriber = harness.connect()
    subscriber.send(b"SUB 1 w/a\r\n")
    assert subscriber.received() == b"SUBACK 1\r\n"


def test_aBrokerWithoutAStoreRefusesRetainedPublishes():
    client = BrokerHarness().connect()
    publish(client, b"w/a", b"x", b" retain=1")
    assert client.received().startswith(b"ERR p STORE_FAILED ")


def test_unsubscribeAndList():
    harness = BrokerHarness()
    subscriber, publisher = harness.connect(), harness.connect()
    subscriber.send(b"SUB 1 a mode=fire\r\nSUB 2 b/# mode=all\r\nUNSUB 3 a\r\nUNSUB 4 a\r\n")
    written = subscriber.received()
    assert written == (
        b"SUBACK 1\r\nSUBACK 2\r\nUNSUBACK 3\r\nERR 4 NOT_SUBSCRIBED not subscribed to 'a'\r\n"
    )
    publish(publisher, b"a", b"gone")
    assert messages(subscriber) == []
    subscriber.send(b"LIST 5\r\n")
    assert document(subscriber.received(), b"LIST") == {
        "count": 1,
        "subscriptions": [{"filter": "b/#", "mode": "all"}],
    }


def test_topicsListsRetainedTopicsAndFiltersBounded():
    harness = harnessWithRetained()
    client = harness.connect()
    publish(client, b"t/1", b"abc", b" retain=1")
    client.send(b"SUB 1 t/+ mode=fire\r\nSUB 2 t/1 mode=fire\r\nTOPICS 3 limit=2\r\n")
    assert document(client.received(), b"TOPICS") == {
        "total": 2,
        "truncated": False,
        "topics": [
            {"topic": "t/+", "retained_bytes": None, "subscribers": 1},
            {"topic": "t/1", "retained_bytes": 3, "subscribers": 1},
        ],
    }
    client.send(b"TOPICS 4 limit=1\r\n")
    assert document(client.received(), b"TOPICS")["truncated"] is True


def test_topicsFollowRetainedAndSubscribedChanges():
    """
    A topic stays listed while it holds a retained message or some client
    is subscribed with it, and goes once neither is true.
    """
    harness = harnessWithRetained()
    client = harness.connect()
    publish(client, b"t/1", b"abc", b" retain=1")
    publish(client, b"t/0", b"x", b" retain=1")
    client.send(b"SUB 1 t/1 mode=fire\r\nSUB 2 t/2 mode=fire\r\n")
    publish(client, b"t/1", b"", b" retain=1")
    client.send(b"UNSUB 3 t/2\r\n")
    client.received()

    def listed():
        client.send(b"TOPICS 9 limit=10\r\n")
        answer = document(client.received(), b"TOPICS")
        return answer["total"], [(row["topic"], row["retained_bytes"]) for row in answer["topics"]]

    assert listed() == (2, [("t/0", 1), ("t/1", None)])
    client.send(b"UNSUB 4 t/1\r\n")
    publish(client, b"t/0", b"", b" retain=1")
    client.received()
    assert listed() == (0, [])


def test_publishToMatchingReachesExistingTopicsOnly():
    harness = harnessWithRetained()
    publisher, subscriber = harness.connect(), harness.connect()
    publish(publisher, b"w/kept", b"k", b" retain=1")
    subscriber.send(b"SUB 1 w/named mode=fire\r\nSUB 2 w/+/deep mode=fire\r\n")
    subscriber.received()
    publisher.received()
    publish(publisher, b"w/#", b"all", b" to-matching=1")
    assert publisher.received() == b"PUBACK p topics=2\r\n"
    assert [(topic, payload) for topic, payload, _ in messages(subscriber)] == [("w/named", b"all")]
