"""
A Twisted client for Dallal brokers: a Deferred API, no threads.

    from dallal.client import connect

    async def main(reactor):
        client = await connect(reactor, "tcp:127.0.0.1:1373")
        await client.subscribe(["news"], lambda message: print(message.payload))
        await client.publish("news", b"hello")
        await client.close()

Requests are pipelined: each carries an id and the Deferred it returned
fires when the matching acknowledgement arrives (or fails with
L{ServerError} when the broker refuses it, or with the connection-lost
reason when the connection goes first).  The client answers the broker's
pings by itself, and acks each message once its handler is done with it.

L{connectUDP} gives the same API over UDP (PROTOCOL.md, "UDP"): the client
says HELLO, resends each request until it is answered (or its Deferred is
cancelled, by a timeout for instance), and pings the broker at the interval
the broker asks for.

Both log in to a broker that takes passwords when given
C{credentials=(user, password)}; the password is sent in the HELLO and kept
for nothing else (over UDP, for the HELLO that resumes a session from a new
address), and never logged.
"""

import itertools
import json
import re
import secrets
from collections import OrderedDict, deque
from dataclasses import dataclass

from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import Deferred, fail, gatherResults, maybeDeferred, succeed
from twisted.internet.endpoints import clientFromString, connectProtocol
from twisted.internet.error import ConnectionDone, ConnectionLost, MessageLengthError
from twisted.internet.protocol import DatagramProtocol
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from dallal.errors import BAD_TOKEN, BUSY, CLOSING, NO_SESSION, RequestError
from dallal.names import checkUserName
from dallal.numbers import wholeNumber
from dallal.protocol import datagram, wire
from dallal.protocol.framing import FrameReceiver
from dallal.topics import MAX_TOPIC_LENGTH

# Resending a request over UDP: after this many seconds, then twice as long
# each time, up to RETRY_MAX_DELAY.
RETRY_FIRST_DELAY = 0.25
RETRY_MAX_DELAY = 1.0
# Requests a UDP client has unanswered at once, and the span of their ids:
# a request whose id is this far past the oldest unanswered one waits.  The
# broker remembers the answers to more than twice as many of a session's
# requests (PROTOCOL.md, "Lost datagrams"), so a resend always finds its
# answer there, however many requests were answered since.
REQUEST_WINDOW = 64
# Reconnecting (a bridge, `dallal subscribe --reconnect`): 1 s after losing
# an established connection, then twice as long after each failure, at most
# 15 s, plus up to 1 s of jitter so that the clients of a restarted broker do
# not all come back in the same instant.
RECONNECT_INITIAL_DELAY = 0.5
RECONNECT_FACTOR = 2.0
RECONNECT_MAX_DELAY = 15.0
# ERR frames tied to no request kept for diagnostics, the latest ones.
SERVER_ERRORS_KEPT = 100
# A HELLO is padded to this size: the broker answers an address that has
# not yet proved it receives with at most three times what it sent.
HELLO_SIZE = 64


class ServerError(Exception):
    """
    The broker refused a request.
    """

    def __init__(self, code, reason):
        Exception.__init__(self, code, reason)
        self.code = code
        self.reason = reason

    def __str__(self):
        return f"{self.code}: {self.reason}"


class ClientProtocolError(Exception):
    """
    The broker sent something this client cannot understand.
    """


def _topicsReached(options):
    """
    The number of topics a PUBACK to a C{to-matching} publish says it reached.
    """
    reached = wholeNumber(options.get("topics", ""), 18)
    if reached is None:
        raise ClientProtocolError(f"unexpected answer to a to-matching publish: {options}")
    return reached


class SessionLost(ConnectionLost):
    """
    The broker no longer knows this UDP client: its session expired, or the
    broker restarted.  Its subscriptions are gone.
    """

    def __str__(self):
        return " ".join(map(str, self.args))


class ClosedUnanswered(ConnectionDone):
    """
    The broker closed the connection before it sent a single frame: what a
    TLS listener does to a client that speaks plain TCP to it.
    """


@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    """
    A message delivered by the broker.

    @ivar seq: its sequence number in its subscription.
    @ivar redelivered: whether the broker sent it before (it was not acked
        in time); the client never hands the same message to its handler
        twice.
    @ivar options: all the frame's C{key=value} options, as text.
    @ivar retained: whether it is the topic's retained message, sent because
        the subscription is new rather than because it was just published.
    """

    topic: str
    payload: bytes
    seq: int
    redelivered: bool
    options: dict
    retained: bool = False


class _SubscriptionState:
    """
    What the client tracks per subscription: who handles its messages,
    gaps and end, and where it is in the sequence.

    @ivar missing: the sequence numbers skipped and not seen since, oldest
        first, each with when its gap is to be reported (C{None} once it
        is).  Over UDP a lost message may still arrive, resent, after later
        ones; it is then handed over, not taken for a duplicate.
    """

    __slots__ = ("topic", "onMessage", "onGap", "onEnded", "lastSeq", "missing")

    # Holes remembered per subscription: in latest mode most are replaced
    # messages that will never come.
    MAX_MISSING = 1024

    def __init__(self, topic, onMessage, onGap, onEnded):
        self.topic = topic
        self.onMessage = onMessage
        self.onGap = onGap
        self.onEnded = onEnded
        self.lastSeq = 0
        self.missing = OrderedDict()

    def skipped(self, first, end, reportAt):
        """
        Sequence numbers C{first} to C{end - 1} were skipped.
        """
        for seq in range(max(first, end - self.MAX_MISSING), end):
            self.missing[seq] = reportAt
        while len(self.missing) > self.MAX_MISSING:
            self.missing.popitem(last=False)

    def arrivedLate(self, seq):
        """
        Whether C{seq} is one of the skipped numbers, now arrived.
        """
        return self.missing.pop(seq, False) is not False


def checkToken(value, what):
    """
    Refuse, before sending, a topic that would break the control line.

    The broker applies the full rules; this only keeps the frame intact.
    """
    if not value or not value.isprintable() or " " in value:
        raise ValueError(f"{what} {value!r} is empty or contains whitespace")


def loginOptions(credentials):
    """
    The HELLO options that log in with C{credentials}: C{(user, password)},
    the password as text (sent as UTF-8) or bytes.

    @raise ValueError: the user name is not one a broker can have.
    """
    user, password = credentials
    checkUserName(user)
    if isinstance(password, str):
        password = password.encode("utf-8")
    return wire.encodeCredentials(user, password)


def _ackable(deliveryId):
    """
    Whether a delivery id can go back in an C{ACK}: 1 to 64 printable ASCII
    characters, as every id of the protocol.
    """
    return (
        0 < len(deliveryId) <= wire.MAX_ID_LENGTH
        and deliveryId.isascii()
        and deliveryId.isprintable()
    )


class _ClientBase:
    """
    What a client does whatever carries its frames: requests matched to
    their answers, messages handed to the application once each and acked,
    gaps in a subscription's sequence reported.

    A transport (L{DallalClientProtocol} over TCP, L{DallalDatagramClient}
    over UDP) provides L{_sendFrame}, parses what the broker sends, and
    hands it to L{_replyReceived} and L{_payloadReceived}.

    @ivar serverErrors: C{ERR} frames not tied to a request, as
        L{ServerError}s, most recent last: the last C{SERVER_ERRORS_KEPT},
        for diagnostics.
    @ivar user: the user name the broker says this client is logged in as,
        or C{None} (not logged in, or the broker takes no passwords).
    """

    _log = Logger()

    def __init__(self):
        self._pending = {}
        self._ids = itertools.count(1)
        self._pingWaiters = []
        self._closeWaiters = []
        # Subscription id (its SUB's request id, the broker's sub=) -> its
        # _SubscriptionState.
        self._subscriptions = {}
        # Deliveries whose handler has not finished: a redelivery of one of
        # them is not handled again, and is acked when the handler is done.
        self._handling = set()
        # Deliveries whose handler failed: their redelivery goes to the
        # handler again instead of being acked as already seen.
        self._failed = set()
        self.serverErrors = deque(maxlen=SERVER_ERRORS_KEPT)
        self.connected = False
        self.lostReason = None
        self.user = None

    def _sendFrame(self, frame):
        """
        Send one frame: bytes, or a sequence of byte strings.
        """
        raise NotImplementedError

    def _lost(self, reason):
        """
        The connection is gone: fail what waits for an answer.
        """
        self.connected = False
        self.lostReason = reason
        pending, self._pending = self._pending, {}
        for deferred in pending.values():
            deferred.errback(reason)
        pingWaiters, self._pingWaiters = self._pingWaiters, []
        for deferred in pingWaiters:
            deferred.errback(reason)
        closeWaiters, self._closeWaiters = self._closeWaiters, []
        for deferred in closeWaiters:
            deferred.callback(None)

    # Requests

    def _takePending(self, requestId):
        """
        The Deferred waiting for the answer to a request, which stops
        waiting; C{None} if none is.
        """
        return self._pending.pop(requestId, None)

    def _sendRequest(self, requestId, frame):
        deferred = Deferred(lambda d: self._takePending(requestId))
        self._pending[requestId] = deferred
        self._sendFrame(frame)
        return deferred

    def _request(self, frame, requestId):
        if not self.connected:
            return fail(self.lostReason or ConnectionDone("not connected"))
        return self._sendRequest(requestId, frame)

    def _nextId(self):
        return str(next(self._ids))

    def publish(self, topic, payload, retain=False, options=None):
        """
        Publish C{payload} (bytes) on C{topic}.

        @param retain: also make it the topic's retained message, which the
            broker sends to every new subscription matching the topic (an
            empty payload clears it); the PubAck then means it is stored.
        @param options: more C{key=value} options of the C{PUB}, as text
            (a bridge's C{origin=}, PROTOCOL.md).
        @return: a Deferred that fires with C{None} on the broker's PubAck.
        """
        checkToken(topic, "topic")
        requestId = self._nextId()
        options = dict(options or {})
        if retain:
            options["retain"] = "1"
        if options:
            frame = wire.encodePublishOptions(requestId, topic, payload, options)
        else:
            frame = wire.encodePublish(requestId, topic, payload)
        return self._request(frame, requestId)

    def publishToMatching(self, topicFilter, payload):
        """
        Publish C{payload} on every existing topic C{topicFilter} matches
        (topics with a retained message, or that clients subscribed to by
        name).

        @return: a Deferred that fires with the number of topics reached.
        """
        checkToken(topicFilter, "topic filter")
        requestId = self._nextId()
        frame = wire.encodePublishOptions(requestId, topicFilter, payload, {"to-matching": "1"})
        return self._request(frame, requestId).addCallback(_topicsReached)

    def unsubscribe(self, topicFilter):
        """
        End the subscription made with C{topicFilter}.

        @return: a Deferred that fires on the broker's UnsubAck, or fails
            with L{ServerError} C{NOT_SUBSCRIBED}.
        """
        checkToken(topicFilter, "topic filter")
        requestId = self._nextId()
        unsubscribed = self._request(wire.encodeUnsubscribe(requestId, topicFilter), requestId)

        def forget(result):
            # Until the UnsubAck, messages in flight still reach the handler.
            self._forgetSubscription(topicFilter)
            return result

        return unsubscribed.addCallback(forget)

    def listSubscriptions(self):
        """
        @return: a Deferred that fires with this client's subscriptions:
            C{{"count": n, "subscriptions": [{"filter": ..., "mode": ...}]}}.
        """
        requestId = self._nextId()
        return self._request(wire.encodeDataRequest(b"LIST", requestId), requestId)

    def topics(self, limit=None):
        """
        @return: a Deferred that fires with the broker's topics:
            C{{"total": n, "truncated": bool, "topics": [{"topic": ...,
            "retained_bytes": size or None, "subscribers": n}]}}.
        """
        requestId = self._nextId()
        options = {} if limit is None else {"limit": str(limit)}
        return self._request(wire.encodeDataRequest(b"TOPICS", requestId, options), requestId)

    def subscribe(self, topics, onMessage, mode=None, onGap=None, options=None, onEnded=None):
        """
        Subscribe to each of C{topics}; C{onMessage(message)} is then called
        with a L{ReceivedMessage} for every message delivered for these
        subscriptions.  The message is acked when C{onMessage} returns or,
        if it returns a Deferred, when that fires: a slow handler slows the
        broker's deliveries down.

        Each subscription keeps its own handlers: subscribing to other
        topics with other handlers leaves these in place.  Subscribing again
        to a topic this client has changes its mode and handlers.  A message
        that matches several of a client's filters arrives once, for one of
        them (PROTOCOL.md, "Subscriptions").

        @param mode: the delivery mode, C{"latest"} (the broker's default),
            C{"all"} or C{"fire"}.
        @param onGap: called as C{onGap(topic, missed)} when a subscription's
            sequence skips C{missed} messages (replaced by newer ones in
            C{latest} mode, or dropped by the broker, or lost by the network
            in C{fire} mode over UDP).
        @param options: more C{key=value} options of each C{SUB}, as text
            (a bridge's C{bridge=1}, PROTOCOL.md).
        @param onEnded: called as C{onEnded(topic, error)} with a
            L{ServerError} when the broker ends a subscription (its ACL,
            read again, no longer lets this client read what it matches).
        @return: a Deferred that fires when every SubAck has arrived, or
            fails with the first refusal.
        """
        topics = [topics] if isinstance(topics, str) else list(topics)
        for topic in topics:
            checkToken(topic, "topic")
        acks = []
        for topic in topics:
            requestId = self._nextId()
            self._subscriptions[requestId] = self._subscriptionState(
                topic, onMessage, onGap, onEnded
            )
            acks.append(
                self._request(wire.encodeSubscribe(requestId, topic, mode, options), requestId)
            )
        return gatherResults(acks, consumeErrors=True).addCallbacks(
            lambda _: None, lambda failure: failure.value.subFailure
        )

    def _subscriptionState(self, topic, onMessage, onGap, onEnded):
        """
        The state of a new subscription to C{topic}, or of the one this
        client has, with new handlers: the broker keeps its sequence.
        """
        for subscriptionId, state in list(self._subscriptions.items()):
            if state.topic == topic:
                del self._subscriptions[subscriptionId]
                state.onMessage = onMessage
                state.onGap = onGap
                state.onEnded = onEnded
                return state
        return _SubscriptionState(topic, onMessage, onGap, onEnded)

    def _forgetSubscription(self, topic):
        for subscriptionId, state in list(self._subscriptions.items()):
            if state.topic == topic:
                del self._subscriptions[subscriptionId]

    def stats(self):
        """
        Ask the broker for its counters.

        @return: a Deferred that fires with a dict of them.
        """
        requestId = self._nextId()
        return self._request(wire.encodeDataRequest(b"STATS", requestId), requestId)

    def ping(self):
        """
        Ping the broker.

        @return: a Deferred that fires on its pong.
        """
        deferred = Deferred(lambda d: self._pingWaiters.remove(d))
        self._pingWaiters.append(deferred)
        self._sendFrame(wire.PING_FRAME)
        return deferred

    def whenDisconnected(self):
        """
        @return: a Deferred that fires (with C{None}) once the connection is
            closed, by either side; L{lostReason} then says why.
        """
        if not self.connected:
            return succeed(None)
        deferred = Deferred(lambda d: self._closeWaiters.remove(d))
        self._closeWaiters.append(deferred)
        return deferred

    # Frames from the broker

    def _replyReceived(self, reply):
        """
        Handle a frame from the broker that has no payload.
        """
        self._replyHandlers[type(reply)](self, reply)

    def _payloadReceived(self, header, payload):
        """
        Handle a C{MSG} frame, or a reply with a JSON payload, and its
        payload.
        """
        if type(header) is wire.DataHeader:
            self._dataReceived(header, payload)
            return
        options = header.options
        deliveryId = options.get("id")
        if deliveryId is not None and not _ackable(deliveryId):
            # The broker's ids are printable ASCII: this one could not be
            # acked, so the message would come back for ever.
            self._log.warn(
                "dropping a message whose delivery id cannot be acked: {id!r}", id=deliveryId
            )
            return
        subscriptionId = options.get("sub")
        subscription = self._subscriptions.get(subscriptionId)
        if subscription is None:
            # Not for this client: over UDP, a resend to the session that
            # had this address (and port) before, whose client vanished
            # without a BYE.  Acking it would ack a delivery of ours.
            self._log.warn(
                "dropping a message for no subscription of this client: {topic} sub={sub}",
                topic=header.topic,
                sub=subscriptionId,
            )
            return
        try:
            seq = int(options.get("seq", "0"))
        except ValueError:
            seq = 0
        if seq:
            if seq > subscription.lastSeq:
                if seq > subscription.lastSeq + 1:
                    self._skipped(subscription, subscription.lastSeq + 1, seq)
                subscription.lastSeq = seq
            elif not subscription.arrivedLate(seq) and deliveryId not in self._failed:
                # Seen before: the broker resent it because our ack was
                # late.  Ack again unless the handler is still busy with it.
                if deliveryId is not None and deliveryId not in self._handling:
                    self._sendFrame(wire.encodeAck(deliveryId))
                return
        self._failed.discard(deliveryId)
        message = ReceivedMessage(
            header.topic,
            payload,
            seq,
            options.get("redelivered") == "1",
            options,
            options.get("retained") == "1",
        )
        handled = maybeDeferred(subscription.onMessage, message)
        if deliveryId is not None:
            self._handling.add(deliveryId)
            handled.addCallbacks(
                self._handled,
                self._handlerFailed,
                callbackArgs=(deliveryId,),
                errbackArgs=(deliveryId,),
            )
        else:
            handled.addErrback(self._handlerFailed, None)

    def _skipped(self, subscription, first, end):
        """
        A subscription's sequence skipped from C{first} to C{end - 1}.  Over
        TCP messages arrive in order, so they will never come: report the
        gap now.
        """
        subscription.skipped(first, end, None)
        if subscription.onGap is not None:
            subscription.onGap(subscription.topic, end - first)

    def _handled(self, result, deliveryId):
        self._handling.discard(deliveryId)
        self._sendFrame(wire.encodeAck(deliveryId))

    def _handlerFailed(self, failure, deliveryId):
        # Not acked: the broker will send the message again.
        if deliveryId is not None:
            self._handling.discard(deliveryId)
            self._failed.add(deliveryId)
        self._log.failure("message handler failed", failure)

    def _dataReceived(self, header, payload):
        deferred = self._takePending(header.id)
        if deferred is None:
            return
        try:
            document = json.loads(payload)
        except (ValueError, RecursionError) as e:
            # RecursionError: nested deeper than the parser goes.
            deferred.errback(ClientProtocolError(f"unreadable {header.verb} payload: {e}"))
        else:
            deferred.callback(document)

    def _handleAck(self, ack):
        # A late ack (its request timed out and was cancelled) finds nothing.
        deferred = self._takePending(ack.id)
        if deferred is not None:
            deferred.callback(ack.options or None)

    def _handleError(self, error):
        failure = ServerError(error.code, error.reason)
        deferred = self._takePending(error.id)
        if deferred is not None:
            deferred.errback(failure)
            return
        self.serverErrors.append(failure)
        self._log.warn("broker error: {error}", error=failure)
        # The id of a subscription: the broker has ended it.
        ended = self._subscriptions.pop(error.id, None)
        if ended is not None and ended.onEnded is not None:
            ended.onEnded(ended.topic, failure)

    def _handlePing(self, ping):
        self._sendFrame(wire.PONG_FRAME)

    def _handlePong(self, pong):
        if self._pingWaiters:
            self._pingWaiters.pop(0).callback(None)

    def _handleHello(self, answer):
        deferred = self._takePending(answer.id)
        if deferred is not None:
            deferred.callback(answer.options)

    def _handleBye(self, bye):
        # The broker closes the connection next.
        pass

    _replyHandlers = {
        wire.PubAck: _handleAck,
        wire.SubAck: _handleAck,
        wire.UnsubAck: _handleAck,
        wire.HelloReply: _handleHello,
        wire.ByeReply: _handleBye,
        wire.Error: _handleError,
        wire.Ping: _handlePing,
        wire.Pong: _handlePong,
    }


class DallalClientProtocol(FrameReceiver, _ClientBase):
    """
    One TCP connection to a broker.
    """

    def __init__(self):
        _ClientBase.__init__(self)
        self._receiving = None
        # The error the broker closes the connection for, once it sent one.
        self._closedFor = None
        self._heardFrom = False

    def connectionMade(self):
        self.connected = True

    def connectionLost(self, reason):
        if self._closedFor is not None:
            # What waits for an answer fails with why, not just "closed".
            reason = Failure(self._closedFor)
        elif not self._heardFrom and type(reason.value) is ConnectionDone:
            reason = Failure(ClosedUnanswered())
        self._lost(reason)

    def _sendFrame(self, frame):
        if self.connected and not self.transport.disconnecting:
            if isinstance(frame, bytes):
                self.transport.write(frame)
            else:
                self.transport.writeSequence(frame)

    def close(self):
        """
        Close the connection.

        @return: a Deferred that fires once it is closed.
        """
        closed = self.whenDisconnected()
        if self.connected:
            self.transport.loseConnection()
        return closed

    def hello(self, clientId, **options):
        """
        The optional hello over TCP: introduce this client (C{name=},
        C{version=} options, as text).

        @return: a Deferred that fires with the broker's answer, a dict of
            its limits (C{max-payload}, C{max-topic}, C{max-levels},
            C{max-subscriptions}, C{max-line}), C{ping} and C{version}.
        """
        checkToken(clientId, "client id")
        requestId = self._nextId()
        return self._request(wire.encodeHello(requestId, clientId, options), requestId)

    def login(self, credentials, clientId=None):
        """
        Log in to a broker that takes passwords: a HELLO with the user name
        and password.

        @param credentials: C{(user, password)}, the password as text or
            bytes.
        @param clientId: who this client is to the broker's ACL (C{%c});
            random by default.
        @return: a Deferred that fires with the broker's answer (as
            L{hello}'s, with C{user}), or fails with L{ServerError}
            C{BAD_CREDENTIALS}, after which the broker closes the
            connection.
        @raise ValueError: the user name is not one a broker can have.
        """
        options = loginOptions(credentials)
        return self.hello(clientId or secrets.token_hex(16), **options).addCallback(self._loggedIn)

    def _loggedIn(self, answer):
        self.user = answer.get("user")
        return answer

    def bye(self):
        """
        Disconnect gracefully: say BYE, and the broker answers BYE and
        closes the connection.

        @return: a Deferred that fires once it is closed.
        """
        closed = self.whenDisconnected()
        self._sendFrame(wire.BYE_FRAME)
        return closed

    def lineReceived(self, line):
        self._heardFrom = True
        try:
            reply = wire.parseReply(line)
        except RequestError as error:
            self._log.error(
                "closing: unexpected frame from the broker: {reason}", reason=error.reason
            )
            self.transport.loseConnection()
            return
        if reply is None:
            return
        if type(reply) in (wire.MessageHeader, wire.DataHeader):
            self._receiving = reply
            self.expectPayload(reply.size)
        else:
            self._replyReceived(reply)

    def payloadReceived(self, payload):
        header, self._receiving = self._receiving, None
        self._payloadReceived(header, payload)

    def _handleError(self, error):
        if error.code in CLOSING:
            self._closedFor = ServerError(error.code, error.reason)
        _ClientBase._handleError(self, error)

    _replyHandlers = {**_ClientBase._replyHandlers, wire.Error: _handleError}


class DallalDatagramClient(DatagramProtocol, _ClientBase):
    """
    A client of a broker over UDP (see L{connectUDP}).

    Its socket is not connected: on Linux an ICMP "port unreachable" on a
    connected UDP socket closes Twisted's port, and this client must keep
    going while the broker is away.  It reads only what comes from the
    broker's address, as a connected socket would.

    @ivar clientId: who this client is to the broker: random unless given.
        A client that restarts must not reuse it while its old session may
        still be alive: the broker keeps the id for that session.
    @ivar sessionKey: the session's secret, from the broker's answer to the
        HELLO that started it: the HELLO that resumes the session from a new
        address echoes it.
    @ivar pingInterval: seconds between pings, as the broker asked.
    @ivar maxPayload: the largest payload the broker accepts over UDP.
    """

    def __init__(self, clock, brokerAddress, clientId=None, onPongMissed=None, credentials=None):
        """
        @param brokerAddress: the broker's C{(ip, port)}.
        @param onPongMissed: called as C{onPongMissed(missed)} when a ping
            has gone unanswered for an interval, C{missed} counting them in
            a row; the client keeps pinging.
        @param credentials: C{(user, password)} to log in with, for a broker
            that takes passwords.
        @raise ValueError: the user name is not one a broker can have.
        """
        _ClientBase.__init__(self)
        self._login = {} if credentials is None else loginOptions(credentials)
        self.clock = clock
        self.brokerAddress = brokerAddress
        self.clientId = clientId if clientId is not None else secrets.token_hex(16)
        self.onPongMissed = onPongMissed
        self.token = None
        self.sessionKey = None
        self.pingInterval = None
        self.maxPayload = datagram.MAX_PAYLOAD
        # Request id -> the DelayedCall that sends it again.
        self._resends = {}
        # Requests sent and unanswered (their ids as numbers, oldest first),
        # and those waiting for room in the window: request id -> frame.
        self._inFlight = OrderedDict()
        self._waiting = OrderedDict()
        # The HELLO waiting for its answer, while saying hello.
        self._helloId = None
        self._rehello = None
        self._pinger = None
        self._awaitingPong = False
        self._missedPongs = 0
        # Ping intervals so far: when skipped messages are given up on.
        self._ticks = 0
        self._stopped = False
        self._forgetShutdownTrigger = None

    # Saying hello

    def handshake(self):
        """
        Start a session with the broker.

        @return: a Deferred that fires with this client once the session is
            in place, and fails with the reason if it cannot be.
        """
        return Deferred.fromCoroutine(self._handshake()).addCallback(self._started)

    async def _handshake(self):
        """
        Say HELLO, then HELLO again with the token the broker answered, until
        the broker accepts the token (it refuses one minted for an address
        the client no longer has).

        @return: the options of the broker's last answer.
        """
        while True:
            answer = await self._hello({})
            token = answer.get("token")
            if not token:
                raise ClientProtocolError("the broker's answer to HELLO has no token")
            try:
                answer = await self._hello({"token": token, **self._login, **self._resumeKey()})
            except ServerError as error:
                if error.code != BAD_TOKEN:
                    raise
                continue
            try:
                self.pingInterval = float(answer["ping"])
                self.maxPayload = int(answer["max-payload"])
            except (KeyError, ValueError):
                raise ClientProtocolError(f"unexpected answer to HELLO: {answer}") from None
            if answer.get("session") not in ("new", "resumed"):
                raise ClientProtocolError(f"unexpected answer to HELLO: {answer}")
            self.token = token
            self.sessionKey = answer.get("key", self.sessionKey)
            self.user = answer.get("user")
            return answer

    def _resumeKey(self):
        """
        The option that proves this client holds its session, once it has
        one.
        """
        return {} if self.sessionKey is None else {"key": self.sessionKey}

    def _hello(self, options):
        requestId = self._helloId = self._nextId()
        frame = wire.encodeHello(requestId, self.clientId, options)
        if "token" not in options and len(frame) < HELLO_SIZE:
            padding = HELLO_SIZE - len(frame) - len(b" pad=")
            frame = wire.encodeHello(
                requestId, self.clientId, {**options, "pad": "x" * max(padding, 1)}
            )
        return self._sendRequest(requestId, frame, self._write)

    def _started(self, answer):
        self.connected = True
        self._pinger = LoopingCall(self._pingTick)
        self._pinger.clock = self.clock
        # A LoopingCall whose function raises stops for good: say so loudly.
        self._pinger.start(self.pingInterval, now=False).addErrback(
            lambda failure: self._log.failure("pinging stopped", failure)
        )
        return self

    def _sayHelloAgain(self):
        """
        The broker refused our token: the client's address changed, or the
        broker restarted.  Get a token for the address we have now, and
        resume the session (or find that it is gone).
        """
        if self._rehello is not None:
            return
        # Nothing else is sent until the new token arrives.
        self.token = None
        self._rehello = Deferred.fromCoroutine(self._handshake())
        self._rehello.addCallbacks(self._resumed, self._sessionLost)

    def _resumed(self, answer):
        self._rehello = None
        if answer["session"] != "resumed":
            self._sessionLost()
            return
        for resend in self._resends.values():
            resend.reset(0)

    def _sessionLost(self, reason=None):
        self._rehello = None
        if not self.connected:
            return
        why = "its session expired, or the broker restarted"
        if reason is not None:
            why = f"{why} ({reason.getErrorMessage()})"
        self._stop(Failure(SessionLost(why)))

    # Sending

    def _write(self, data):
        try:
            self.transport.write(data, self.brokerAddress)
        except (OSError, MessageLengthError) as error:
            # Lost, as the network could have lost it: requests are resent.
            self._log.warn("could not send a datagram: {error}", error=error)

    def _sendFrame(self, frame):
        if self.token is not None:
            self._write(datagram.withIdentity(frame, self.clientId, self.token))

    def _sendRequest(self, requestId, frame, send=None):
        """
        Send a request, and send it again until it is answered.  A request
        of the session waits while the window is full (L{REQUEST_WINDOW});
        a HELLO (C{send} given) goes at once.
        """
        deferred = Deferred(lambda d: self._takePending(requestId))
        self._pending[requestId] = deferred
        if send is not None:
            self._resend(requestId, frame, send, RETRY_FIRST_DELAY)
        else:
            self._waiting[requestId] = frame
            self._sendWaiting()
        return deferred

    def _sendWaiting(self):
        """
        Send the requests waiting, oldest first, as far as the window allows.
        """
        while self._waiting:
            requestId, frame = next(iter(self._waiting.items()))
            number = int(requestId)
            if self._inFlight:
                oldest = next(iter(self._inFlight.values()))
                if len(self._inFlight) >= REQUEST_WINDOW or number - oldest >= REQUEST_WINDOW:
                    return
            del self._waiting[requestId]
            self._inFlight[requestId] = number
            self._resend(requestId, frame, self._sendFrame, RETRY_FIRST_DELAY)

    def _resend(self, requestId, frame, send, delay):
        send(frame)
        if requestId in self._pending:
            self._resends[requestId] = self.clock.callLater(
                delay, self._resend, requestId, frame, send, min(2 * delay, RETRY_MAX_DELAY)
            )

    def _takePending(self, requestId):
        resend = self._resends.pop(requestId, None)
        if resend is not None and resend.active():
            resend.cancel()
        self._waiting.pop(requestId, None)
        if self._inFlight.pop(requestId, None) is not None:
            self._sendWaiting()
        return _ClientBase._takePending(self, requestId)

    def publish(self, topic, payload, retain=False, options=None):
        """
        Publish C{payload} (bytes) on C{topic}, and with C{retain} keep it as
        the topic's retained message (see L{_ClientBase.publish}).

        @return: a Deferred that fires with C{None} on the broker's PubAck.
        @raise ValueError: the message does not fit in a datagram.
        """
        if len(payload) > self.maxPayload:
            raise ValueError(
                f"a payload of {len(payload)} bytes is larger than the "
                f"{self.maxPayload} bytes the broker accepts over UDP"
            )
        if len(topic.encode("utf-8")) > MAX_TOPIC_LENGTH:
            raise ValueError(f"topic is longer than {MAX_TOPIC_LENGTH} bytes")
        return _ClientBase.publish(self, topic, payload, retain, options)

    # Health

    def _skipped(self, subscription, first, end):
        # A datagram lost on the way is resent, and may arrive later than
        # the ones after it: give it a whole ping interval, reporting it at
        # the second ping from now.
        subscription.skipped(first, end, self._ticks + 2)

    def _reportGaps(self):
        for subscription in self._subscriptions.values():
            given = [
                seq
                for seq, reportAt in subscription.missing.items()
                if reportAt is not None and reportAt <= self._ticks
            ]
            for seq in given:
                subscription.missing[seq] = None
            if given and subscription.onGap is not None:
                subscription.onGap(subscription.topic, len(given))

    def _pingTick(self):
        self._ticks += 1
        self._reportGaps()
        if self._awaitingPong:
            self._missedPongs += 1
            if self.onPongMissed is not None:
                self.onPongMissed(self._missedPongs)
        self._awaitingPong = True
        self._sendFrame(wire.PING_FRAME)

    def _handlePong(self, pong):
        self._awaitingPong = False
        self._missedPongs = 0
        _ClientBase._handlePong(self, pong)

    # Closing

    def closeWithReactor(self, reactor):
        """
        Close when the reactor stops (as it closes TCP connections then), so
        that the broker forgets this client at once instead of expiring it.
        """
        trigger = reactor.addSystemEventTrigger("before", "shutdown", self._reactorStopping)
        self._forgetShutdownTrigger = lambda: reactor.removeSystemEventTrigger(trigger)

    def _reactorStopping(self):
        # The trigger is running: removing it now would be an error.
        self._forgetShutdownTrigger = None
        return self.close()

    def close(self):
        """
        Say BYE (once: if it is lost, the broker expires the session) and
        stop.

        @return: a Deferred that fires once the client is closed.
        """
        closed = self.whenDisconnected()
        if self.connected:
            self._sendFrame(wire.BYE_FRAME)
            self._stop(Failure(ConnectionDone("closed by the client")))
        return closed

    def _stop(self, reason):
        """
        Stop sending, fail what waits, and close the socket.
        """
        if self._stopped:
            return
        self._stopped = True
        self.token = None
        if self._forgetShutdownTrigger is not None:
            self._forgetShutdownTrigger()
            self._forgetShutdownTrigger = None
        self._lost(reason)
        if self._pinger is not None and self._pinger.running:
            self._pinger.stop()
        resends, self._resends = self._resends, {}
        for resend in resends.values():
            if resend.active():
                resend.cancel()
        self._waiting.clear()
        self._inFlight.clear()
        if self._rehello is not None:
            self._rehello.cancel()
        if self.transport is not None:
            self.transport.stopListening()

    # Datagrams from the broker

    def datagramReceived(self, data, address):
        # A datagram read after close() would reach a handler told the
        # client is closed.
        if address != self.brokerAddress or self._stopped:
            return
        try:
            line, rest = datagram.splitDatagram(data)
            reply = wire.parseReply(line)
            if reply is None:
                return
            if type(reply) in (wire.MessageHeader, wire.DataHeader):
                self._payloadReceived(reply, datagram.payloadOf(rest, reply.size))
            else:
                datagram.checkNothingAfter(rest)
                self._replyReceived(reply)
        except RequestError as error:
            # Nothing to fall out of step with: drop it.
            self._log.warn(
                "dropping a datagram the broker should not have sent: {reason}",
                reason=error.reason,
            )

    def _handleError(self, error):
        if error.code == BAD_TOKEN and error.id != self._helloId:
            # The request waits, and is resent once the session is resumed.
            self._sayHelloAgain()
        elif error.code == NO_SESSION:
            self._sessionLost()
        elif error.code == BUSY and error.id in self._pending:
            # Nothing was published: the request's resends go on until one
            # is taken.
            pass
        else:
            _ClientBase._handleError(self, error)

    _replyHandlers = {
        **_ClientBase._replyHandlers,
        wire.Error: _handleError,
        wire.Pong: _handlePong,
    }


def connect(reactor, endpoint, credentials=None, clientId=None):
    """
    Connect to a broker, and log in if given credentials.

    @param endpoint: an C{IStreamClientEndpoint}, or a client endpoint
        description such as C{"tcp:127.0.0.1:1373"}.
    @param credentials: C{(user, password)}, for a broker that takes
        passwords (see L{DallalClientProtocol.login}).
    @param clientId: the client id of the login; random by default.
    @return: a Deferred firing with a connected (and logged in)
        L{DallalClientProtocol}; if the login fails, it fails with the
        broker's L{ServerError} and the connection is closed.
    """
    if isinstance(endpoint, str):
        endpoint = clientFromString(reactor, endpoint)
    connecting = connectProtocol(endpoint, DallalClientProtocol())
    if credentials is None:
        return connecting
    return connecting.addCallback(_logIn, credentials, clientId)


def _logIn(client, credentials, clientId):
    def failed(failure):
        client.close()
        return failure

    return maybeDeferred(client.login, credentials, clientId).addCallbacks(
        lambda answer: client, failed
    )


_PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL
)


def tlsEndpoint(reactor, host, port, cafile=None):
    """
    An endpoint to a broker over TLS (its C{--tcp ssl:...} listener), for
    L{connect}: the broker's certificate must be signed by a CA of
    C{cafile}, or of the system's roots, and be for C{host} (a DNS name, or
    an IP address in the certificate's subjectAltName).

    Twisted's C{tls:host=...:port=...:trustRoots=DIRECTORY} endpoint
    description does the same with a directory of C{.pem} files.

    @param cafile: the path of a PEM file of one or more CA certificates.
    @raise ValueError: C{cafile} cannot be read or holds no certificate.
    @raise ImportError: pyOpenSSL is missing (C{pip install twisted[tls]}).
    """
    from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
    from twisted.internet.ssl import Certificate, optionsForClientTLS, trustRootFromCertificates

    trustRoot = None
    if cafile is not None:
        try:
            with open(cafile, "rb") as file:
                blocks = _PEM_CERTIFICATE.findall(file.read())
            certificates = [Certificate.loadPEM(block) for block in blocks]
        except OSError as error:
            raise ValueError(f"cannot read the CA file {cafile}: {error.strerror}") from error
        except Exception as error:
            raise ValueError(
                f"the CA file {cafile} holds an unreadable certificate: {error}"
            ) from error
        if not certificates:
            raise ValueError(f"the CA file {cafile} holds no PEM certificate")
        trustRoot = trustRootFromCertificates(certificates)
    return wrapClientTLS(
        optionsForClientTLS(host, trustRoot=trustRoot),
        HostnameEndpoint(reactor, host, port),
    )


def connectUDP(reactor, host, port, clientId=None, onPongMissed=None, credentials=None):
    """
    Start a session with a broker over UDP.

    @param host: the broker's host name or IP address.
    @param clientId: see L{DallalDatagramClient}; random by default.
    @param onPongMissed: see L{DallalDatagramClient}.
    @param credentials: C{(user, password)}, for a broker that takes
        passwords.
    @return: a Deferred firing with a L{DallalDatagramClient} once the
        broker has accepted it (and its login); cancel it to give up.
    """
    return Deferred.fromCoroutine(
        _connectUDP(reactor, host, port, clientId, onPongMissed, credentials)
    )


async def _connectUDP(reactor, host, port, clientId, onPongMissed, credentials):
    ip = host if isIPAddress(host) or isIPv6Address(host) else await reactor.resolve(host)
    client = DallalDatagramClient(reactor, (ip, port), clientId, onPongMissed, credentials)
    reactor.listenUDP(
        0,
        client,
        interface="::" if isIPv6Address(ip) else "",
        maxPacketSize=datagram.MAX_PACKET_SIZE,
    )
    try:
        await client.handshake()
    except BaseException:
        client._stop(Failure())
        raise
    client.closeWithReactor(reactor)
    return client
