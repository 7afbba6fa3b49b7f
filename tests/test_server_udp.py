"""
The broker over UDP (L{dallal.server.udp}), over in-memory datagram
transports on a C{task.Clock}: what it sends, logs and counts.
"""

import json
import re

import pytest
from helpers import KEY, PING_INTERVAL, TOKEN, MemoryRetained, UdpHarness, messages, resultOf
from hypothesis import given, settings, strategies
from twisted.internet.defer import Deferred

from dallal import __version__
from dallal.broker.retained import StoreError
from dallal.protocol.datagram import MAX_PAYLOAD
from dallal.server import udp


@pytest.fixture
def harness():
    return UdpHarness()


# Saying hello, and tokens


def test_helloAnswersATokenAndStartsNothing(harness):
    """
    A HELLO without a token is answered with a token bound to the client id
    and the address; no session starts until the token comes back.
    """
    alice = harness.peer(40001)
    alice.send(b"HELLO 1 me\r\n")
    [answer] = alice.received()
    assert re.fullmatch(rb"HELLO 1 token=[A-Za-z0-9_-]{16}\r\n", answer)
    other = harness.peer(40002)
    other.send(b"HELLO 1 me\r\n")
    assert TOKEN.search(other.received()[0]).group(1) != TOKEN.search(answer).group(1)
    assert harness.fields("connect") == []
    assert harness.counter("connections") == 0


def test_helloWithTheTokenStartsASession(harness):
    alice = harness.peer(40001)
    answer = alice.hello("me")
    assert answer == (
        b"HELLO 2 token=%s version=%s ping=10 max-payload=65000 max-topic=256 "
        b"max-levels=32 max-subscriptions=1000 max-line=4096 key=%s session=new\r\n"
        % (alice.token, __version__.encode(), alice.key)
    )
    assert harness.fields("connect") == [
        {"session": 1, "client": "127.0.0.1:40001", "transport": "udp"}
    ]


def test_sessionOverUdp(harness):
    """
    Subscribe, publish, receive and ack, ping and stats, as PROTOCOL.md's
    UDP session shows them.
    """
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"SUB 3 news")
    assert alice.received() == [b"SUBACK 3\r\n"]
    alice.publish(b"4", b"news", b"hello world")
    assert alice.received() == [
        b"MSG news 11 sub=3 seq=1 id=1\r\nhello world\r\n",
        b"PUBACK 4\r\n",
    ]
    alice.request(b"ACK 1")
    alice.request(b"PING")
    assert alice.received() == [b"PONG\r\n"]
    alice.request(b"STATS 5")
    [stats] = alice.received()
    line, payload = stats.split(b"\r\n", 1)
    assert line == b"STATS 5 %d" % (len(payload) - 2)
    assert json.loads(payload)["acked"] == 1
    alice.request(b"BYE")
    assert alice.received() == [b"BYE\r\n"]
    assert harness.fields("disconnect") == [
        {
            "session": 1,
            "client": "127.0.0.1:40001",
            "transport": "udp",
            "reason": "closed",
            "subscriptions": 1,
        }
    ]


def test_bridgesAreRefusedOverUdp(harness):
    """
    Bridges connect over TCP: their subscriptions and publishes are refused
    over UDP (PROTOCOL.md, "Bridges").
    """
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"SUB 3 news mode=all bridge=1")
    alice.request(b"PUB 4 news 2 origin=leaf oid=a.1 hops=0", b"hi")
    refusals = alice.received()
    assert [refusal.split(b" ", 3)[:3] for refusal in refusals] == [
        [b"ERR", b"3", b"BAD_ARGUMENTS"],
        [b"ERR", b"4", b"BAD_ARGUMENTS"],
    ]
    assert b"bridges connect over TCP" in refusals[0]
    assert harness.counter("subscriptions") == 0
    assert harness.counter("published") == 0


@pytest.mark.parametrize(
    "identity",
    [b"", b" client=me token=AAAAAAAAAAAAAAAA", b" client=someone-else token=%s"],
)
def test_requestWithoutItsTokenIsRefused(harness, identity):
    """
    A request without the client's identity, with a made-up token, or with
    another client's id is refused: nothing is subscribed.
    """
    alice = harness.peer(40001)
    alice.hello("me")
    if b"%s" in identity:
        identity %= alice.token
    alice.send(b"SUB 3 news" + identity + b"\r\n")
    [refusal] = alice.received()
    assert refusal.startswith(b"ERR 3 BAD_TOKEN ")
    assert harness.counter("subscriptions") == 0
    assert harness.counter("errors") == 1


def test_tokenOfAnotherAddressIsRefused(harness):
    """
    A token works only from the address it was given to: a forger who
    learnt it cannot use it from elsewhere.
    """
    alice = harness.peer(40001)
    alice.hello("me")
    mallory = harness.peer(40666)
    mallory.clientId, mallory.token = alice.clientId, alice.token
    mallory.request(b"SUB 3 news")
    assert mallory.received()[0].startswith(b"ERR 3 BAD_TOKEN ")
    assert harness.counter("subscriptions") == 0


def test_forgedHelloStreamsNothingToTheVictim(harness):
    """
    A forger who sends HELLO and SUB with a victim's address as their source
    never sees the victim's token, so cannot subscribe it: the victim gets
    no more than three times the bytes forged in its name.
    """
    publisher = harness.peer(40001)
    publisher.hello("publisher")
    victim = harness.peer(40999)
    victim.send(b"HELLO 1 victim pad=" + b"x" * 40 + b"\r\n")
    for guess in range(20):
        victim.send(b"HELLO 2 victim token=%016d\r\n" % guess)
        victim.send(b"SUB %d news mode=all client=victim token=%016d\r\n" % (guess, guess))
    for number in range(50):
        publisher.publish(b"%d" % number, b"news", b"x" * 1000)
    assert not any(data.startswith(b"MSG") for data in victim.received())
    assert harness.bytesSentTo(victim.address) <= 3 * victim.sentBytes
    assert harness.counter("connections") == 1


# Anti-amplification


def test_shortDatagramsFromAStrangerAreNotAnsweredBeyondThreeTimes(harness):
    """
    An unproven address is sent at most three times what it sent: a short
    bad request gets no answer, and that is counted.
    """
    stranger = harness.peer(40001)
    stranger.send(b"X\n")
    assert stranger.received() == []
    assert harness.counter("unsent") == 1
    assert harness.counter("errors") == 1
    assert harness.fields("protocol_error") == [
        {"session": 0, "client": "127.0.0.1:40001", "code": "BAD_COMMAND", "fatal": False}
    ]


def test_strangerBudgetAccumulates(harness):
    """
    What a stranger sent earlier counts: the answers it was not sent leave
    room for later ones, never more than three times in all.
    """
    stranger = harness.peer(40001)
    for _ in range(4):
        stranger.send(b"BAD\n")
    answers = stranger.received()
    assert answers
    assert len(answers) < 4
    assert harness.bytesSentTo(stranger.address) <= 3 * stranger.sentBytes


def test_floodOfBadDatagramsIsCountedButLoggedTenASecond(harness):
    """
    Datagrams that name no session may come from forged addresses at any
    rate: each is counted, but at most ten a second are logged one by one;
    the rest are reported by code in one event a second later.
    """
    for port in range(40001, 40026):
        harness.peer(port).send(b"PING 1\r\n")
        harness.peer(port).send(b"BAD\n")
    assert harness.counter("errors") == 50
    assert len(harness.fields("protocol_error")) == 10
    assert harness.fields("protocol_errors_suppressed") == []
    harness.clock.advance(1)
    assert harness.fields("protocol_errors_suppressed") == [
        {"code": "BAD_COMMAND", "count": 20},
        {"code": "BAD_TOKEN", "count": 20},
    ]
    harness.peer(40001).send(b"BAD\n")
    assert len(harness.fields("protocol_error")) == 11


def test_suppressedErrorsAreReportedBeforeTheFinalCounters(harness):
    """
    The count of refusals not yet reported is logged when the broker shuts
    down, before its final counters, and only then.
    """
    for port in range(40001, 40013):
        harness.peer(port).send(b"BAD\n")
    harness.broker.shutdown()
    assert harness.fields("protocol_errors_suppressed") == [{"code": "BAD_COMMAND", "count": 2}]
    names = [event.get("dallal_event") for event in harness.events]
    assert names.index("protocol_errors_suppressed") < names.index("stats")
    harness.udp.doStop()
    harness.clock.advance(1)
    assert len(harness.fields("protocol_errors_suppressed")) == 1


def test_helloOf32BytesIsAlwaysAnswered(harness):
    """
    PROTOCOL.md: a HELLO of 32 bytes or more always gets its token, even
    with the longest request id.
    """
    stranger = harness.peer(40001)
    hello = b"HELLO " + b"i" * 64 + b" c\r\n"
    assert len(hello) >= 32
    stranger.send(hello)
    assert len(stranger.received()) == 1
    shortest = harness.peer(40002)
    shortest.send(b"HELLO 1 me pad=xxxxxxxxxxxxxxxx\n")
    assert len(shortest.received()) == 1


def test_provenAddressIsNotLimited(harness):
    """
    Once an address has echoed its token, the broker answers it in full,
    even a request too short to pay for its answer.
    """
    alice = harness.peer(40001)
    alice.hello()
    alice.send(b"X\n")
    [refusal] = alice.received()
    assert refusal.startswith(b"ERR - BAD_COMMAND ")


def test_unprovenAddressesAreForgottenOldestFirst(harness, monkeypatch):
    """
    The table of unproven addresses is bounded: the least recently heard
    is forgotten first, and with it what it may still be sent.
    """
    monkeypatch.setattr(udp, "MAX_UNPROVEN_ADDRESSES", 2)
    first = harness.peer(40001)
    first.send(b"HELLO 1 me pad=" + b"x" * 200 + b"\n")
    assert len(first.received()) == 1
    first.send(b"X\n")
    assert len(first.received()) == 1  # paid for by the long HELLO
    harness.peer(40002).send(b"X\n")
    harness.peer(40003).send(b"X\n")
    first.send(b"X\n")
    assert first.received() == []


# Expiry


def test_clientThatPingsStaysAlive(harness):
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"SUB 3 news")
    for _ in range(20):
        harness.clock.advance(PING_INTERVAL)
        alice.request(b"PING")
    assert harness.fields("ping_missed") == []
    assert harness.fields("disconnect") == []


def test_silentClientExpires(harness):
    """
    A client that stops pinging is reported each interval, then expired:
    the log says which client, with its address and port, and its
    subscriptions and queued messages are dropped and counted.
    """
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"SUB 3 news mode=all")
    publisher = harness.peer(40002)
    publisher.hello("publisher")
    harness.clock.advance(0.5)
    publisher.publish(b"1", b"news", b"unacked")
    for _ in range(3):
        # The publisher keeps pinging; alice is silent.
        harness.clock.advance(PING_INTERVAL)
        publisher.request(b"PING")
    harness.clock.advance(PING_INTERVAL)
    assert [fields["missed"] for fields in harness.fields("ping_missed")] == [1, 2]
    assert harness.fields("client_dropped") == [
        {"session": 1, "client": "127.0.0.1:40001", "missed": 3}
    ]
    assert harness.fields("disconnect") == [
        {
            "session": 1,
            "client": "127.0.0.1:40001",
            "transport": "udp",
            "reason": "expired",
            "subscriptions": 1,
        }
    ]
    stats = harness.broker.stats()
    assert (stats["subscriptions"], stats["clients_dropped"], stats["dropped_disconnected"]) == (
        0,
        1,
        1,
    )
    assert stats["inflight"] == 0
    alice.request(b"PING")
    assert alice.received()[-1].startswith(b"ERR - NO_SESSION ")


# Reliability


def newsSubscriberAndPublisher(harness):
    """
    Two clients with sessions: one subscribed to C{news} in C{fire} mode,
    and one to publish.
    """
    subscriber = harness.peer(40001)
    subscriber.hello("subscriber")
    subscriber.request(b"SUB 1 news mode=fire")
    subscriber.received()
    publisher = harness.peer(40002)
    publisher.hello("publisher")
    return subscriber, publisher


def test_retriedPublishIsPublishedOnce(harness):
    """
    A client that did not get its PubAck sends the PUB again: the broker
    answers it again and does not publish it twice.
    """
    subscriber, publisher = newsSubscriberAndPublisher(harness)
    for _ in range(3):
        publisher.publish(b"7", b"news", b"once")
    assert publisher.received() == [b"PUBACK 7\r\n"] * 3
    assert len(subscriber.received()) == 1
    assert (harness.counter("published"), harness.counter("duplicates")) == (1, 2)


class SlowRetained(MemoryRetained):
    """
    A retained store whose writes finish when the test says so.
    """

    def __init__(self):
        MemoryRetained.__init__(self)
        self.writes = []

    def set(self, topic, payload):
        self.writes.append(Deferred())
        return self.writes[-1]

    def match(self, topicFilter):
        return []


def test_retriedRetainedPublishIsPublishedOnce(harness):
    """
    A retained PUB is acked once it is stored: a retry that comes while it
    is being stored gets no second copy published and no early answer, and a
    retry after it was stored gets the same PubAck.
    """
    harness.broker.retained = SlowRetained()
    subscriber, publisher = newsSubscriberAndPublisher(harness)
    publisher.request(b"PUB 7 news 4 retain=1", b"once")
    publisher.request(b"PUB 7 news 4 retain=1", b"once")
    assert publisher.received() == []
    [write] = harness.broker.retained.writes
    write.callback(None)
    publisher.request(b"PUB 7 news 4 retain=1", b"once")
    assert publisher.received() == [b"PUBACK 7\r\n"] * 2
    assert len(subscriber.received()) == 1
    assert (harness.counter("published"), harness.counter("duplicates")) == (1, 2)


def test_retriedRetainedPublishThatWasNotStoredIsNotPublishedAgain(harness):
    """
    A retained PUB whose store write failed was still published: its retry
    gets the same STORE_FAILED answer, not a second copy.
    """
    harness.broker.retained = SlowRetained()
    publisher = harness.peer(40002)
    publisher.hello("publisher")
    publisher.request(b"PUB 7 news 4 retain=1", b"once")
    harness.broker.retained.writes[0].errback(StoreError("disk full"))
    publisher.request(b"PUB 7 news 4 retain=1", b"once")
    answers = publisher.received()
    assert [answer.split()[:3] for answer in answers] == [[b"ERR", b"7", b"STORE_FAILED"]] * 2
    assert b"disk full" in answers[0]
    assert harness.counter("published") == 1
    assert len(harness.broker.retained.writes) == 1


def test_refusedRequestIsJudgedAgainWhenRetried(harness):
    alice = harness.peer(40001)
    alice.hello()
    alice.publish(b"7", b"+bad", b"x")
    alice.publish(b"7", b"+bad", b"x")
    assert [answer.split()[:3] for answer in alice.received()] == [[b"ERR", b"7", b"BAD_TOPIC"]] * 2
    assert harness.counter("duplicates") == 0


def test_unackedMessageIsResentEveryUdpAckTimeout(harness):
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"SUB 1 news mode=all")
    alice.received()
    bob = harness.peer(40002)
    bob.hello("bob")
    bob.publish(b"1", b"news", b"hi")
    assert alice.received() == [b"MSG news 2 sub=1 seq=1 id=1\r\nhi\r\n"]
    harness.clock.advance(1.0)
    assert alice.received() == [b"MSG news 2 sub=1 seq=1 id=1 redelivered=1\r\nhi\r\n"]
    alice.request(b"ACK 1")
    harness.clock.advance(5.0)
    assert alice.received() == []
    assert harness.counter("acked") == 1


def test_stoppingBrokerTakesAcksButNoNewSessions(harness):
    """
    While the broker drains, a UDP subscriber's ack still settles its
    message (and ends the drain), and a new client's HELLO is refused with
    SHUTTING_DOWN instead of starting a session.
    """
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"SUB 1 news mode=all")
    bob = harness.peer(40002)
    bob.hello("bob")
    bob.publish(b"1", b"news", b"hi")
    alice.received()

    stopped = harness.service.stopService()
    carol = harness.peer(40003)
    carol.send(b"HELLO 1 carol pad=%s\r\n" % (b"x" * 32))
    [answer] = carol.received()
    token = TOKEN.search(answer).group(1)
    carol.send(b"HELLO 2 carol token=%s\r\n" % token)
    [refused] = carol.received()
    assert refused.startswith(b"ERR 2 SHUTTING_DOWN ")
    assert harness.counter("connections") == 2
    alice.request(b"ACK 1")
    harness.clock.advance(0.1)
    resultOf(stopped)
    assert harness.counter("acked") == 1


def test_udpResendsForAsLongAsTcp():
    """
    Resending every second instead of every 10, a UDP subscriber gets as
    many seconds to ack as a TCP one: 50 attempts instead of 5.
    """
    delivery = udp.datagramDelivery(UdpHarness().broker.config.delivery, 1.0)
    assert (delivery.ackTimeout, delivery.maxAttempts) == (1.0, 50)
    assert delivery.maxPayload == MAX_PAYLOAD


def test_fireModeIsSentOnce(harness):
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"SUB 1 news mode=fire")
    alice.received()
    alice.publish(b"2", b"news", b"hi")
    harness.clock.advance(30)
    assert messages(b"".join(alice.received())) == [(b"news", b"hi")]
    assert harness.counter("fired") == 1


# Address change


def test_addressChangeKeepsTheSession(harness):
    """
    A client whose port changes says HELLO from the new one and resumes its
    session there: its subscriptions stay, and its messages follow it.
    """
    old = harness.peer(40001)
    old.hello("roamer")
    old.request(b"SUB 1 news mode=fire")
    old.received()
    new = harness.peer(50001)
    new.clientId, new.token = old.clientId, old.token
    new.request(b"PING")
    assert new.received()[0].startswith(b"ERR - BAD_TOKEN ")
    assert new.hello("roamer", key=old.key).endswith(b" session=resumed\r\n")
    publisher = harness.peer(40002)
    publisher.hello("publisher")
    publisher.publish(b"1", b"news", b"follows")
    assert old.received() == []
    assert messages(b"".join(new.received())) == [(b"news", b"follows")]
    assert len(harness.fields("connect")) == 2


def test_helloFromElsewhereDoesNotMoveTheSession(harness):
    """
    Asking for a token from another address moves nothing: only echoing it
    does.
    """
    home = harness.peer(40001)
    home.hello("me")
    home.request(b"SUB 1 news mode=fire")
    home.received()
    elsewhere = harness.peer(40999)
    elsewhere.send(b"HELLO 1 me pad=xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\r\n")
    publisher = harness.peer(40002)
    publisher.hello("publisher")
    publisher.publish(b"1", b"news", b"stays")
    assert messages(b"".join(home.received())) == [(b"news", b"stays")]


# A client id is not a credential


def hijacker(harness, victimId):
    """
    A sender at its own address that knows a victim's client id: it gets a
    token for that id at its address, as anyone can, and tries to resume
    the victim's session without its key.

    @return: the L{Peer}, and the broker's answer to its second HELLO.
    """
    mallory = harness.peer(40666, host="127.0.0.66")
    answer = mallory.hello(victimId)
    return mallory, answer


def victimWithAMessageInFlight(harness):
    """
    A victim subscribed in mode C{all} to C{news}, with one message sent
    to it and not acked yet (delivery id 1).
    """
    victim = harness.peer(40001)
    victim.hello("victim")
    victim.request(b"SUB 1 news mode=all")
    assert victim.received() == [b"SUBACK 1\r\n"]
    publisher = harness.peer(40002)
    publisher.hello("publisher")
    publisher.publish(b"1", b"news", b"first")
    assert messages(b"".join(victim.received())) == [(b"news", b"first")]
    return victim, publisher


@pytest.mark.parametrize(
    "request_, payload",
    [
        (b"SUB 7 #", None),
        (b"UNSUB 7 news", None),
        (b"PUB 7 news 6", b"forged"),
        (b"ACK 1", None),
        (b"PING", None),
        (b"LIST 7", None),
        (b"BYE", None),
    ],
)
def test_clientIdDoesNotLetAStrangerUseASession(harness, request_, payload):
    """
    The hijack of issue 24: a sender that knows a victim's client id says
    HELLO with it from its own address and gets a token there.  The HELLO
    that would resume the session is refused without the session's key,
    and the requests it signs with that token are refused: the victim's
    session stays where it is, with its subscriptions and its messages.
    """
    victim, publisher = victimWithAMessageInFlight(harness)
    mallory, answer = hijacker(harness, "victim")
    assert answer.startswith(b"ERR 2 NOT_AUTHORIZED this client id names a session ")
    assert KEY.search(answer) is None
    mallory.request(request_, payload)
    [refusal] = mallory.received()
    assert refusal.split(b" ", 3)[2] == b"BAD_TOKEN"
    assert b"session is at another address" in refusal
    # The message not acked by the victim is resent to the victim, and
    # what is published next reaches it, at its address.
    harness.clock.advance(1.0)
    publisher.publish(b"2", b"news", b"second")
    assert messages(b"".join(victim.received())) == [(b"news", b"first"), (b"news", b"second")]
    assert mallory.received() == []
    assert harness.counter("published") == 2
    assert len(harness.fields("connect")) == 2
    assert harness.fields("disconnect") == []
    victim.request(b"LIST 8")
    assert json.loads(victim.received()[0].split(b"\r\n")[1])["count"] == 1


def test_sessionKeyMovesTheSession(harness):
    """
    The key the broker gave the victim resumes its session elsewhere; a
    wrong one does not.
    """
    victim, publisher = victimWithAMessageInFlight(harness)
    mallory = harness.peer(40666, host="127.0.0.66")
    answer = mallory.hello("victim", key=b"A" * 22)
    assert answer.startswith(b"ERR 2 NOT_AUTHORIZED ")
    roamed = harness.peer(50001)
    assert roamed.hello("victim", key=victim.key).endswith(b" session=resumed\r\n")
    assert roamed.key == victim.key
    harness.clock.advance(1.0)
    assert messages(b"".join(roamed.received())) == [(b"news", b"first")]
    assert victim.received() == []


def test_helloResentFromTheSessionsAddressGetsItsKey(harness):
    """
    A client whose answer to its HELLO was lost says it again from the same
    address: the answer goes there, with the session's key, as the first.
    """
    alice = harness.peer(40001)
    alice.hello("me")
    first = alice.key
    alice.send(b"HELLO 2 me token=%s\r\n" % alice.token)
    [answer] = alice.received()
    assert answer.endswith(b" key=%s session=resumed\r\n" % first)


# Size


def test_payloadLargerThanADatagramCarriesIsRefused(harness):
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"PUB 1 news %d" % (MAX_PAYLOAD + 1), b"x" * 10)
    [refusal] = alice.received()
    assert refusal.startswith(b"ERR 1 PAYLOAD_TOO_LARGE ")


def test_payloadOfTheWrongSizeIsRefused(harness):
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"PUB 1 news 5", b"hello!")
    alice.request(b"SUB 2 news", b"")
    assert [answer.split()[:3] for answer in alice.received()] == [
        [b"ERR", b"1", b"BAD_FRAMING"],
        [b"ERR", b"2", b"BAD_FRAMING"],
    ]
    assert harness.counter("published") == 0


def test_largestPayloadArrivesWhole(harness):
    """
    A payload of the largest size is carried in one datagram, with a long
    topic and subscription id, and a redelivery flag.
    """
    topic = b"t" * 256
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"SUB " + b"s" * 64 + b" " + topic + b" mode=all")
    alice.received()
    payload = bytes(range(256)) * (MAX_PAYLOAD // 256) + b"\n" * (MAX_PAYLOAD % 256)
    alice.publish(b"1", topic, payload)
    harness.clock.advance(1.0)
    first, _, redelivered = alice.received()
    assert len(redelivered) <= 65507
    assert messages(first) == messages(redelivered) == [(topic, payload)]


def test_answerTooLargeForADatagramIsRefused(harness, monkeypatch):
    """
    An answer with a payload that no datagram can carry is replaced by an
    error, which the client's retries get too.
    """
    alice = harness.peer(40001)
    alice.hello()
    stats = harness.broker.stats
    monkeypatch.setattr(
        harness.broker, "stats", lambda: {**stats(), "padding": "x" * MAX_PAYLOAD * 2}
    )
    alice.request(b"STATS 5")
    alice.request(b"STATS 5")
    assert [answer.split()[:3] for answer in alice.received()] == [
        [b"ERR", b"5", b"PAYLOAD_TOO_LARGE"]
    ] * 2


def test_tcpMessageTooLargeForUdpIsDroppedAndCounted(harness):
    """
    A message published over TCP that no datagram can carry reaches the TCP
    subscribers; a UDP subscriber's sequence skips it, as too_large.
    """
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"SUB 1 news mode=all")
    alice.received()
    tcpSubscriber = harness.connect()
    tcpSubscriber.send(b"SUB 1 news mode=fire\r\n")
    publisher = harness.connect()
    big = b"x" * (MAX_PAYLOAD + 1)
    publisher.send(b"PUB 1 news %d\r\n%s\r\n" % (len(big), big), b"PUB 2 news 5\r\nsmall\r\n")
    assert messages(tcpSubscriber.received()) == [(b"news", big), (b"news", b"small")]
    [small] = alice.received()
    assert small.startswith(b"MSG news 5 sub=1 seq=2 ")
    assert harness.counter("dropped_too_large") == 1


# Both transports, one core


def test_udpAndTcpShareOneBroker(harness):
    alice = harness.peer(40001)
    alice.hello()
    alice.request(b"SUB 1 news mode=fire")
    alice.received()
    tcpClient = harness.connect()
    tcpClient.send(b"SUB 1 news mode=fire\r\n")
    tcpClient.received()
    tcpClient.send(b"PUB 2 news 8\r\nfrom tcp\r\n")
    alice.publish(b"2", b"news", b"from udp")
    assert messages(b"".join(alice.received())) == [(b"news", b"from tcp"), (b"news", b"from udp")]
    assert messages(tcpClient.received()) == [(b"news", b"from tcp"), (b"news", b"from udp")]
    assert [fields["transport"] for fields in harness.fields("publish")] == ["tcp", "udp"]


# Nothing a datagram holds crashes the broker


@pytest.mark.parametrize(
    "datagram",
    [
        b"",
        b"\r\n",
        b"\xff\xfe\x00",
        b"HELLO",
        b"HELLO 1",
        b"HELLO 1 " + b"c" * 65,
        b"HELLO 1 me token",
        b"HELLO 1 me\r\ntrailing",
        b"PUB 1 news 99999999999999 client=a token=b",
        b"ACK client=a token=b",
        b"STATS client=a token=b",
        b"x" * 5000,
        b"BYE",
    ],
)
def test_malformedDatagrams(harness, datagram):
    stranger = harness.peer(40001)
    stranger.send(datagram)
    assert harness.bytesSentTo(stranger.address) <= 3 * len(datagram)
    assert harness.counter("connections") == 0


@settings(derandomize=True, max_examples=300, deadline=None)
@given(
    datagrams=strategies.lists(
        strategies.tuples(
            strategies.integers(min_value=0, max_value=2),
            strategies.one_of(
                strategies.binary(max_size=200),
                strategies.builds(
                    lambda verb, rest: verb + rest,
                    strategies.sampled_from(
                        [b"HELLO 1 me ", b"PUB 1 a 3 ", b"SUB 1 a ", b"ACK ", b"PING ", b"BYE "]
                    ),
                    strategies.binary(max_size=100),
                ),
            ),
        ),
        max_size=20,
    )
)
def test_anyDatagramsFromStrangers(datagrams):
    """
    Whatever unproven addresses send, the broker neither raises nor sends
    any of them more than three times what it sent, and counts every
    refusal.
    """
    harness = UdpHarness()
    peers = [harness.peer(40001 + index) for index in range(3)]
    for index, data in datagrams:
        peers[index].send(data)
    for peer in peers:
        assert harness.bytesSentTo(peer.address) <= 3 * peer.sentBytes
    harness.clock.advance(1)
    suppressed = sum(event["count"] for event in harness.fields("protocol_errors_suppressed"))
    assert harness.counter("errors") == len(harness.fields("protocol_error")) + suppressed
