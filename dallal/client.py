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
pings by itself.
"""

import itertools
from dataclasses import dataclass

from twisted.internet.defer import Deferred, gatherResults, succeed
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

    @ivar options: the frame's C{key=value} options, as text.
    """

    topic: str
    payload: bytes
    options: dict


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

    def subscribe(self, topics, onMessage):
        """
        Subscribe to each of C{topics}; C{onMessage(message)} is then called
        with a L{ReceivedMessage} for every message delivered on this
        connection.

        @return: a Deferred that fires when every SubAck has arrived, or
            fails with the first refusal.
        """
        topics = [topics] if isinstance(topics, str) else list(topics)
        for topic in topics:
            checkToken(topic, "topic")
        self._onMessage = onMessage
        acks = []
        for topic in topics:
            requestId = self._nextId()
            acks.append(self._request(wire.encodeSubscribe(requestId, topic), requestId))
        return gatherResults(acks, consumeErrors=True).addCallbacks(
            lambda _: None, lambda failure: failure.value.subFailure
        )

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
        if self._onMessage is not None:
            self._onMessage(ReceivedMessage(header.topic, payload, header.options))

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
        self.transport.write(wire.PONG_FRAME)

    def _handlePong(self, pong):
        if self._pingWaiters:
            self._pingWaiters.pop(0).callback(None)

    _handlers = {
        wire.MessageHeader: _handleMessage,
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
