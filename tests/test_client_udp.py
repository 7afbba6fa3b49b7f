"""
The UDP client (L{dallal.client.udp.DallalDatagramClient}) over in-memory
datagram transports on a C{task.Clock}, against a broker typed by the test,
then against the real broker's UDP port over a lossy network.
"""

import pytest
from helpers import PING_INTERVAL, FakeDatagramTransport, UdpHarness
from helpers import UDP_BROKER as BROKER
from twisted.internet.task import Clock

from dallal import client
from dallal.client import DallalDatagramClient, SessionLost

SESSION_KEY = b"Kx" * 11


class FakeBroker:
    """
    The broker's side of a L{DallalDatagramClient} under test: what the
    client sent, and answers typed by the test.
    """

    def __init__(self):
        self.clock = Clock()
        self.pongsMissed = []
        self.client = DallalDatagramClient(
            self.clock, BROKER, clientId="me", onPongMissed=self.pongsMissed.append
        )
        self.transport = FakeDatagramTransport(("127.0.0.1", 40001))
        self.client.makeConnection(self.transport)
        self._seen = 0

    def sent(self):
        """
        The datagrams the client sent since the last call.
        """
        assert all(to == BROKER for _, to in self.transport.written)
        new = [data for data, _ in self.transport.written[self._seen :]]
        self._seen = len(self.transport.written)
        return new

    def answer(self, data):
        self.client.datagramReceived(data, BROKER)

    def handshake(self, ping=10):
        started = []
        self.client.handshake().addCallback(started.append)
        [hello] = self.sent()
        self.answer(b"HELLO 1 token=TOKEN\r\n")
        [hello] = self.sent()
        assert hello == b"HELLO 2 me token=TOKEN\r\n"
        self.answer(
            b"HELLO 2 token=TOKEN ping=%d max-payload=1000 key=%s session=new\r\n"
            % (ping, SESSION_KEY)
        )
        assert started == [self.client]


def test_clientPadsItsHelloAndResendsIt():
    """
    The first HELLO is padded to 64 bytes, and resent after 0.25 s, then
    twice as long each time up to a second.
    """
    broker = FakeBroker()
    broker.client.handshake()
    [hello] = broker.sent()
    assert hello.startswith(b"HELLO 1 me pad=x")
    assert len(hello) == 64
    for delay in [0.25, 0.5, 1, 1, 1]:
        broker.clock.advance(delay - 0.01)
        assert broker.sent() == []
        broker.clock.advance(0.01)
        assert broker.sent() == [hello]


def test_clientRequestsCarryItsIdentityAndAreResentUntilAnswered():
    broker = FakeBroker()
    broker.handshake()
    published = []
    broker.client.publish("news", b"hi").addCallback(published.append)
    assert broker.sent() == [b"PUB 3 news 2 client=me token=TOKEN\r\nhi\r\n"]
    broker.clock.advance(0.25)
    assert broker.sent() == [b"PUB 3 news 2 client=me token=TOKEN\r\nhi\r\n"]
    broker.answer(b"PUBACK 3\r\n")
    assert published == [None]
    broker.clock.advance(5)
    assert [data for data in broker.sent() if not data.startswith(b"PING")] == []


def test_clientKeepsAWindowOfRequestsUnanswered():
    """
    The client has at most REQUEST_WINDOW requests unanswered, their ids
    within that span of the oldest: a request past it waits for the oldest
    to be answered, so a lost answer's resend never trails more than the
    window's requests the broker answered since.
    """
    broker = FakeBroker()
    broker.handshake()
    window = client.REQUEST_WINDOW
    for _number in range(window + 2):
        broker.client.publish("news", b"hi").addErrback(lambda failure: None)
    sent = broker.sent()
    assert [data.split()[1] for data in sent] == [b"%d" % (3 + n) for n in range(window)]
    # A later request answered makes no room: the oldest is still unanswered.
    broker.answer(b"PUBACK 4\r\n")
    assert broker.sent() == []
    broker.clock.advance(0.25)
    assert b"PUB 3 " in b"".join(broker.sent())
    # The oldest answered: the window now starts at 5.
    broker.answer(b"PUBACK 3\r\n")
    assert [data.split()[1] for data in broker.sent()] == [
        b"%d" % (3 + window),
        b"%d" % (4 + window),
    ]


def test_aWaitingRequestCancelledIsNeverSent():
    broker = FakeBroker()
    broker.handshake()
    for _number in range(client.REQUEST_WINDOW):
        broker.client.publish("news", b"hi")
    waiting = broker.client.publish("news", b"last")
    waiting.addErrback(lambda failure: None)
    broker.sent()
    waiting.cancel()
    broker.answer(b"PUBACK 3\r\n")
    broker.clock.advance(5)
    assert not any(b"last" in data for data in broker.sent())


def test_cancelledRequestIsNotResent():
    broker = FakeBroker()
    broker.handshake()
    publishing = broker.client.publish("news", b"hi")
    publishing.addErrback(lambda failure: None)
    broker.sent()
    publishing.cancel()
    broker.clock.advance(5)
    assert [data for data in broker.sent() if data.startswith(b"PUB")] == []


def test_clientRefusesAPayloadTooLargeBeforeSending():
    broker = FakeBroker()
    broker.handshake()
    with pytest.raises(ValueError, match="1001 bytes is larger than the 1000 bytes"):
        broker.client.publish("news", b"x" * 1001)
    assert broker.sent() == []


def test_clientPingsAtTheBrokersIntervalAndReportsMissingPongs():
    broker = FakeBroker()
    broker.handshake(ping=2)
    broker.clock.advance(2)
    assert broker.sent() == [b"PING client=me token=TOKEN\r\n"]
    broker.answer(b"PONG\r\n")
    broker.clock.advance(2)
    broker.clock.advance(2)
    broker.clock.advance(2)
    assert broker.pongsMissed == [1, 2]
    assert len(broker.sent()) == 3
    broker.answer(b"PONG\r\n")
    broker.clock.advance(2)
    assert broker.pongsMissed == [1, 2]
    assert broker.client.connected


def test_clientSaysHelloAgainWhenItsTokenIsRefused():
    """
    A BAD_TOKEN (the client's address changed) makes the client say HELLO
    again, echoing its session's key; its waiting request is sent again
    with the new token.
    """
    broker = FakeBroker()
    broker.handshake()
    published = []
    broker.client.publish("news", b"hi").addCallback(published.append)
    broker.sent()
    broker.answer(b"ERR 3 BAD_TOKEN say HELLO\r\n")
    [hello] = broker.sent()
    assert hello.startswith(b"HELLO 4 me pad=")
    broker.clock.advance(0.25)
    assert all(data.startswith(b"HELLO 4 ") for data in broker.sent())
    broker.answer(b"HELLO 4 token=NEW\r\n")
    assert broker.sent() == [b"HELLO 5 me token=NEW key=%s\r\n" % SESSION_KEY]
    broker.answer(b"HELLO 5 token=NEW ping=10 max-payload=1000 session=resumed\r\n")
    broker.clock.advance(0)
    assert b"PUB 3 news 2 client=me token=NEW\r\nhi\r\n" in broker.sent()
    broker.answer(b"PUBACK 3\r\n")
    assert published == [None]


@pytest.mark.parametrize(
    "answer",
    [
        [b"ERR - NO_SESSION gone\r\n"],
        [
            b"ERR - BAD_TOKEN say HELLO\r\n",
            b"HELLO 3 token=NEW\r\n",
            b"HELLO 4 token=NEW ping=10 max-payload=1000 session=new\r\n",
        ],
    ],
)
def test_clientWhoseSessionIsGoneStops(answer):
    """
    The broker forgot the client (it expired it, or restarted): its
    subscriptions are gone, so the client stops and says why.
    """
    broker = FakeBroker()
    broker.handshake()
    disconnected = []
    broker.client.whenDisconnected().addCallback(disconnected.append)
    for data in answer:
        broker.answer(data)
    assert disconnected == [None]
    assert broker.client.lostReason.check(SessionLost)
    assert not broker.transport.listening


def test_clientIgnoresDatagramsFromOthers():
    broker = FakeBroker()
    broker.handshake()
    received = []
    broker.client.subscribe(["news"], received.append)
    broker.sent()
    broker.answer(b"SUBACK 3\r\n")
    broker.client.datagramReceived(b"MSG news 2 sub=3 seq=1\r\nhi\r\n", ("127.0.0.1", 666))
    broker.answer(b"MSG news 5 sub=3 seq=1\r\nhello\r\n")
    assert [message.payload for message in received] == [b"hello"]


def test_clientDropsAMessageForASubscriptionItDoesNotHave():
    """
    A message whose C{sub=} is none of this client's subscriptions -- over
    UDP, a resend to the session that had this port before, whose client
    vanished without a BYE -- is neither handed over nor acked (the ack
    would settle a delivery of this client's with the same id), before the
    client subscribes and after.
    """
    broker = FakeBroker()
    broker.handshake()
    broker.answer(b"MSG old 5 sub=3 seq=4 id=1\r\nstale\r\n")
    received = []
    broker.client.subscribe(["news"], received.append)
    broker.answer(b"SUBACK 3\r\n")
    broker.sent()
    broker.answer(b"MSG old 5 sub=9 seq=5 id=2 redelivered=1\r\nstale\r\n")
    broker.answer(b"MSG news 5 sub=3 seq=1 id=1\r\nhello\r\n")
    assert [message.payload for message in received] == [b"hello"]
    assert broker.sent() == [b"ACK 1 client=me token=TOKEN\r\n"]


def test_clientHandsOverAMessageThatArrivesLate():
    """
    Over UDP a lost message, resent, arrives after later ones: it is handed
    over once, and its gap is not reported; a duplicate is acked again but
    not handed over twice.
    """
    broker = FakeBroker()
    broker.handshake()
    received, gaps = [], []
    broker.client.subscribe(["news"], received.append, onGap=lambda *gap: gaps.append(gap))
    broker.answer(b"SUBACK 3\r\n")
    broker.sent()
    broker.answer(b"MSG news 3 sub=3 seq=2 id=12\r\ntwo\r\n")
    broker.answer(b"MSG news 3 sub=3 seq=1 id=11 redelivered=1\r\none\r\n")
    broker.answer(b"MSG news 3 sub=3 seq=1 id=11 redelivered=1\r\none\r\n")
    assert [message.payload for message in received] == [b"two", b"one"]
    assert broker.sent() == [
        b"ACK 12 client=me token=TOKEN\r\n",
        b"ACK 11 client=me token=TOKEN\r\n",
        b"ACK 11 client=me token=TOKEN\r\n",
    ]
    broker.clock.advance(30)
    assert gaps == []


def test_clientReportsAGapThatStaysOpenForAPingInterval():
    broker = FakeBroker()
    broker.handshake(ping=10)
    received, gaps = [], []
    broker.client.subscribe(["news"], received.append, onGap=lambda *gap: gaps.append(gap))
    broker.answer(b"SUBACK 3\r\n")
    broker.clock.advance(5)
    broker.answer(b"MSG news 4 sub=3 seq=4\r\nfour\r\n")
    broker.clock.advance(5)
    assert gaps == []
    broker.clock.advance(10)
    assert gaps == [("news", 3)]
    broker.answer(b"MSG news 3 sub=3 seq=2\r\ntwo\r\n")
    broker.clock.advance(30)
    assert gaps == [("news", 3)]
    assert [message.payload for message in received] == [b"four", b"two"]


def test_clientCloseSaysBye():
    broker = FakeBroker()
    broker.handshake()
    closed = []
    broker.client.close().addCallback(closed.append)
    assert broker.sent() == [b"BYE client=me token=TOKEN\r\n"]
    assert closed == [None]
    assert not broker.transport.listening
    broker.clock.advance(60)
    assert broker.sent() == []


# Client and broker over a lossy network


class LossyNetwork:
    """
    Delivers datagrams between in-memory ports after a millisecond, and
    drops every C{loseEvery}th datagram (every third by default; none if
    C{0}) in each direction between two addresses.
    """

    def __init__(self, clock, loseEvery=3):
        self.clock = clock
        self.loseEvery = loseEvery
        self.protocols = {}
        self.sent = {}
        self.dropped = 0

    def attach(self, protocol, address):
        """
        Give C{protocol} a port at C{address}, or put its port there.
        """
        self.protocols[address] = protocol
        if protocol.transport is None:
            protocol.makeConnection(FakeDatagramTransport(address, self))
        else:
            protocol.transport.network = self

    def send(self, source, destination, data):
        count = self.sent[source, destination] = self.sent.get((source, destination), 0) + 1
        if self.loseEvery and count % self.loseEvery == 0:
            self.dropped += 1
            return
        receiver = self.protocols.get(destination)
        if receiver is not None:
            self.clock.callLater(0.001, receiver.datagramReceived, data, source)

    def run(self, seconds):
        for _ in range(int(seconds / 0.01)):
            self.clock.advance(0.01)


def test_allModeThroughALossyNetworkDeliversEachMessageOnce():
    """
    With one datagram in three lost each way, every message a publisher saw
    PubAck'd reaches an C{all}-mode subscriber's handler exactly once.
    """
    harness = UdpHarness()
    network = LossyNetwork(harness.clock)
    network.attach(harness.udp, BROKER)
    subscriber = DallalDatagramClient(harness.clock, BROKER, clientId="subscriber")
    publisher = DallalDatagramClient(harness.clock, BROKER, clientId="publisher")
    network.attach(subscriber, ("127.0.0.1", 40001))
    network.attach(publisher, ("127.0.0.1", 40002))
    started = []
    subscriber.handshake().addCallback(started.append)
    publisher.handshake().addCallback(started.append)
    network.run(3)
    assert len(started) == 2
    received = []
    subscribed = []
    subscriber.subscribe(["news"], received.append, mode="all").addCallback(subscribed.append)
    network.run(3)
    assert subscribed == [None]
    acked = []
    for number in range(30):
        payload = b"message %d" % number
        publisher.publish("news", payload).addCallback(
            lambda _, payload=payload: acked.append(payload)
        )
    network.run(30)
    assert sorted(acked) == sorted(b"message %d" % number for number in range(30))
    assert sorted(message.payload for message in received) == sorted(acked)
    assert network.dropped > 30
    stats = harness.broker.stats()
    assert (stats["published"], stats["acked"], stats["inflight"]) == (30, 30, 0)
    assert stats["duplicates"] > 0


def test_clientResumesItsSessionAfterANatRebindingAndNoOneElseCan():
    """
    The client's port changes (a NAT forgot it): its next request is
    refused, it says HELLO again with its session key, and its messages
    reach it at the new port.  Another client with the same client id, at
    another address, cannot start or take the session.
    """
    harness = UdpHarness()
    network = LossyNetwork(harness.clock, loseEvery=0)
    network.attach(harness.udp, BROKER)
    subscriber = DallalDatagramClient(harness.clock, BROKER, clientId="roamer")
    publisher = DallalDatagramClient(harness.clock, BROKER, clientId="publisher")
    network.attach(subscriber, ("127.0.0.1", 40001))
    network.attach(publisher, ("127.0.0.1", 40002))
    subscriber.handshake()
    publisher.handshake()
    network.run(1)
    received = []
    subscriber.subscribe(["news"], received.append, mode="all")
    network.run(1)
    del network.protocols[("127.0.0.1", 40001)]
    subscriber.transport.address = ("127.0.0.1", 50001)
    network.attach(subscriber, subscriber.transport.address)
    publisher.publish("news", b"after the rebinding")
    network.run(PING_INTERVAL + 2)
    assert [message.payload for message in received] == [b"after the rebinding"]
    assert subscriber.connected
    impostor = DallalDatagramClient(harness.clock, BROKER, clientId="roamer")
    network.attach(impostor, ("127.0.0.66", 40666))
    failures = []
    impostor.handshake().addErrback(failures.append)
    network.run(1)
    [failure] = failures
    assert failure.value.code == "NOT_AUTHORIZED"
    publisher.publish("news", b"still mine")
    network.run(2)
    assert [message.payload for message in received][-1] == b"still mine"
    assert len(harness.fields("connect")) == 2
