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
"""

import itertools
import json
from dataclasses import dataclass

from twisted.internet.defer import Deferred, fail, gatherResults, maybeDeferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.internet.endpoints import clientFromString, connectProtocol
from twisted.logger import Logger

from dallal import wire
from dallal.errors import RequestError
from dallal.framing import FrameReceiver


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


@dataclass(frozen=True, slots=True)
class ReceivedMessage:
    """
    A message delivered by the broker.

    @ivar seq: its sequence number in its subscription.
    @ivar redelivered: whether the broker sent it before (it was not acked
        in time); the client never hands the same message to its handler
        twice.
    @ivar options: all the frame's C{key=value} options, as text.
    """

    topic: str
    payload: bytes
    seq: int
    redelivered: bool
    options: dict


class _SubscriptionState:
    """
    What the client tracks per subscription: where it is in the sequence.
    """

    __slots__ = ("topic", "lastSeq")

    def __init__(self, topic):
        self.topic = topic
        self.lastSeq = 0


def checkToken(value, what):
    """
    Refuse, before sending, a topic that would break the control line.

    The broker applies the full rules; this only keeps the frame intact.
    """
    if not value or not value.isprintable() or " " in value:
        raise ValueError(f"{what} {value!r} is empty or contains whitespace")


class DallalClientProtocol(FrameReceiver):
    """
    One connection to a broker.

    @ivar serverErrors: C{ERR} frames not tied to a request, as
        L{ServerError}s, most recent last (kept for diagnostics).
    """

    _log = Logger()

    def __init__(self):
        self._pending = {}
        self._ids = itertools.count(1)
        self._pingWaiters = []
        self._closeWaiters = []
        self._onMessage = None
        self._onGap = None
        self._subscriptions = {}
        # Deliveries whose handler has not finished: a redelivery of one of
        # them is not handled again, and is acked when the handler is done.
        self._handling = set()
        # Deliveries whose handler failed: their redelivery goes to the
        # handler again instead of being acked as already seen.
        self._failed = set()
        self._receiving = None
        self.serverErrors = []
        self.connected = False
        self.lostReason = None

    def connectionMade(self):
        self.connected = True

    def connectionLost(self, reason):
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

    def _request(self, frame, requestId):
        if not self.connected:
            return fail(self.lostReason or ConnectionDone("not connected"))
        deferred = Deferred(lambda d: self._pending.pop(requestId, None))
        self._pending[requestId] = deferred
        self.transport.writeSequence(frame if isinstance(frame, tuple) else (frame,))
        return deferred

    def _nextId(self):
        return str(next(self._ids))

    def publish(self, topic, payload):
        """
        Publish C{payload} (bytes) on C{topic}.

        @return: a Deferred that fires with C{None} on the broker's PubAck.
        """
        checkToken(topic, "topic")
        requestId = self._nextId()
        return self._request(wire.encodePublish(requestId, topic, payload), requestId)

    def subscribe(self, topics, onMessage, mode=None, onGap=None):
        """
        Subscribe to each of C{topics}; C{onMessage(message)} is then called
        with a L{ReceivedMessage} for every message delivered on this
        connection.  The message is acked when C{onMessage} returns or, if
        it returns a Deferred, when that fires: a slow handler slows the
        broker's deliveries down.

        @param mode: the delivery mode, C{"latest"} (the broker's default),
            C{"all"} or C{"fire"}.
        @param onGap: called as C{onGap(topic, missed)} when a subscription's
            sequence skips C{missed} messages (replaced by newer ones in
            C{latest} mode, or dropped by the broker).
        @return: a Deferred that fires when every SubAck has arrived, or
            fails with the first refusal.
        """
        topics = [topics] if isinstance(topics, str) else list(topics)
        for topic in topics:
            checkToken(topic, "topic")
        self._onMessage = onMessage
        self._onGap = onGap
        acks = []
        for topic in topics:
            requestId = self._nextId()
            self._subscriptions[requestId] = _SubscriptionState(topic)
            acks.append(
                self._request(wire.encodeSubscribe(requestId, topic, mode), requestId)
            )
        return gatherResults(acks, consumeErrors=True).addCallbacks(
            lambda _: None, lambda failure: failure.value.subFailure
        )

    def stats(self):
        """
        Ask the broker for its counters.

        @return: a Deferred that fires with a dict of them.
        """
        requestId = self._nextId()
        return self._request(wire.encodeStatsRequest(requestId), requestId)

    def ping(self):
        """
        Ping the broker.

        @return: a Deferred that fires on its pong.
        """
        deferred = Deferred(lambda d: self._pingWaiters.remove(d))
        self._pingWaiters.append(deferred)
        self.transport.write(wire.PING_FRAME)
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

    def close(self):
        """
        Close the connection.

        @return: a Deferred that fires once it is closed.
        """
        closed = self.whenDisconnected()
        if self.connected:
            self.transport.loseConnection()
        return closed

    # Frames from the broker

    def lineReceived(self, line):
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
        self._handlers[type(reply)](self, reply)

    def _handleMessage(self, header):
        self._receiving = header
        self.expectPayload(header.size)

    def payloadReceived(self, payload):
        header, self._receiving = self._receiving, None
        if type(header) is wire.StatsHeader:
            self._statsReceived(header, payload)
            return
        options = header.options
        deliveryId = options.get("id")
        subscription = self._subscriptions.get(options.get("sub"))
        try:
            seq = int(options.get("seq", "0"))
        except ValueError:
            seq = 0
        if subscription is not None and seq:
            if seq <= subscription.lastSeq and deliveryId not in self._failed:
                # Seen before: the broker resent it because our ack was
                # late.  Ack again unless the handler is still busy with it.
                if deliveryId is not None and deliveryId not in self._handling:
                    self._write(wire.encodeAck(deliveryId))
                return
            if seq > subscription.lastSeq:
                missed = seq - subscription.lastSeq - 1
                subscription.lastSeq = seq
                if missed and self._onGap is not None:
                    self._onGap(subscription.topic, missed)
        self._failed.discard(deliveryId)
        message = ReceivedMessage(
            header.topic, payload, seq, options.get("redelivered") == "1", options
        )
        handled = maybeDeferred(self._onMessage, message)
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

    def _handled(self, result, deliveryId):
        self._handling.discard(deliveryId)
        self._write(wire.encodeAck(deliveryId))

    def _handlerFailed(self, failure, deliveryId):
        # Not acked: the broker will send the message again.
        if deliveryId is not None:
            self._handling.discard(deliveryId)
            self._failed.add(deliveryId)
        self._log.failure("message handler failed", failure)

    def _statsReceived(self, header, payload):
        deferred = self._pending.pop(header.id, None)
        if deferred is None:
            return
        try:
            stats = json.loads(payload)
        except ValueError as e:
            deferred.errback(ClientProtocolError(f"unreadable STATS payload: {e}"))
        else:
            deferred.callback(stats)

    def _write(self, data):
        if self.connected and not self.transport.disconnecting:
            self.transport.write(data)

    def _handleAck(self, ack):
        # A late ack (its request timed out and was cancelled) finds nothing.
        deferred = self._pending.pop(ack.id, None)
        if deferred is not None:
            deferred.callback(None)

    def _handleError(self, error):
        failure = ServerError(error.code, error.reason)
        deferred = self._pending.pop(error.id, None)
        if deferred is not None:
            deferred.errback(failure)
        else:
            self.serverErrors.append(failure)
            self._log.warn("broker error: {error}", error=failure)

    def _handlePing(self, ping):
        self._write(wire.PONG_FRAME)

    def _handlePong(self, pong):
        if self._pingWaiters:
            self._pingWaiters.pop(0).callback(None)

    _handlers = {
        wire.MessageHeader: _handleMessage,
        wire.StatsHeader: _handleMessage,
        wire.PubAck: _handleAck,
        wire.SubAck: _handleAck,
        wire.Error: _handleError,
        wire.Ping: _handlePing,
        wire.Pong: _handlePong,
    }


def connect(reactor, endpoint):
    """
    Connect to a broker.

    @param endpoint: an C{IStreamClientEndpoint}, or a client endpoint
        description such as C{"tcp:127.0.0.1:1373"}.
    @return: a Deferred firing with a connected L{DallalClientProtocol}.
    """
    if isinstance(endpoint, str):
        endpoint = clientFromString(reactor, endpoint)
    return connectProtocol(endpoint, DallalClientProtocol())
