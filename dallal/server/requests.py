"""
A client session's requests, carried out on the broker core and answered.

TCP and UDP frame requests differently (a stream of frames, one frame per
datagram) but carry them out the same way: L{RequestHandler} is that
shared part.  A transport parses a control line with L{dallal.protocol.wire},
reads the payload its own way, and hands the request here; the answers go
back through the transport's L{RequestHandler.sendFrame}.
"""

import json

from dallal.errors import BAD_ARGUMENTS, BROKER_STATE, FORBIDDEN, RequestError
from dallal.limits import CONSECUTIVE_ERRORS, LISTED
from dallal.modes import LATEST
from dallal.numbers import wholeNumber
from dallal.protocol import wire
from dallal.server.origins import originFromOptions


def helloLimits(config, maxPayload):
    """
    The limits the answer to a HELLO tells a client, as its options.

    @param config: the broker's L{dallal.broker.core.BrokerConfig}.
    @param maxPayload: the largest payload the client's transport accepts.
    """
    return {
        "max-payload": str(maxPayload),
        "max-topic": str(config.maxTopicLength),
        "max-levels": str(config.maxTopicLevels),
        "max-subscriptions": str(config.maxSubscriptions),
        "max-line": str(config.maxControlLine),
    }


class RequestHandler:
    """
    Mixin for a transport's session: carries out its requests.

    The session is the L{ISubscriber} the broker core knows; it provides
    C{broker} (the core), L{sendFrame} and L{pongReceived}.
    """

    broker = None
    # Whether this transport carries bridges between brokers (TCP does:
    # bridges connect over stream endpoints).
    carriesBridges = False
    # Whether the client made a bridge subscription: its messages then
    # carry their origin.
    bridging = False

    def sendFrame(self, *chunks):
        """
        Send one frame, given as byte strings to concatenate, to the client.
        """
        raise NotImplementedError

    def pongReceived(self):
        """
        The client answered the broker's ping.
        """
        raise NotImplementedError

    def handleRequest(self, request):
        """
        Carry out a parsed request other than C{PUB} (whose payload the
        transport reads first, then calls L{publish}).
        """
        self._requestHandlers[type(request)](self, request)

    def refuse(self, error, fatal=False):
        """
        Answer a refused request with C{ERR}, and count it.
        """
        self.sendFrame(wire.encodeError(error.requestId, error.code, error.reason))
        self.broker.protocolError(self, error.code, fatal)

    # Requests refused in a row: a client that means well reads its errors
    # long before --max-consecutive-errors, a stream of garbage costs an
    # ERR and a count each until its session ends.

    errorStreak = 0
    # What the last ERR of a run says happens now.
    endOfErrorStreak = "closing the connection"

    def errorStreakOver(self, error):
        """
        Count a refused request in the client's run of errors (refusals
        that are the broker's state, L{BROKER_STATE}, do not count).

        @return: whether the run reached C{--max-consecutive-errors}.
        """
        if error.code in BROKER_STATE:
            return False
        self.errorStreak += 1
        return self.errorStreak >= self.broker.config.maxConsecutiveErrors

    def tooManyErrors(self):
        """
        Count and log the refusal that ends a client's run of errors.

        @return: the L{RequestError} to send it, with id C{-}.
        """
        maximum = self.broker.config.maxConsecutiveErrors
        return self.broker.refusedByLimit(
            self,
            CONSECUTIVE_ERRORS,
            maximum,
            f"the last {maximum} requests were all refused: {self.endOfErrorStreak}",
        )

    def carriedOut(self, streak):
        """
        A request was handled: if nothing of it was refused (the run of
        errors is still C{streak} long), the run is over.
        """
        if self.errorStreak == streak:
            self.errorStreak = 0

    def subscriptionRevoked(self, subscriptionId, reason):
        """
        Tell the client the broker ended a subscription, with an C{ERR}
        bearing the subscription's id.
        """
        self.sendFrame(wire.encodeError(subscriptionId, FORBIDDEN, reason))

    def publish(self, request, payload):
        options = request.options
        # Most publishes have no options: one test skips looking up each.
        retain = options.get("retain") == "1" if options else False
        try:
            if options and "origin" in options:
                self._publishBridged(request, payload)
                return
            if options and options.get("to-matching") == "1":
                if retain:
                    raise RequestError(
                        BAD_ARGUMENTS,
                        "retain=1 and to-matching=1 do not go together: retain names one topic",
                        request.id,
                    )
                reached = self.broker.publishToMatching(self, request.topic, payload, request.id)
                self.sendFrame(wire.encodePubAck(request.id, {"topics": str(reached)}))
                return
            if retain:
                self.broker.checkRetainable(self, request.topic, payload, request.id)
            self.broker.publish(self, request.topic, payload, request.id)
            stored = self.broker.retain(request.topic, payload, request.id) if retain else None
        except RequestError as error:
            self.refuse(error)
            return
        if stored is None:
            self.sendFrame(wire.encodePubAck(request.id))
        else:
            self.answerWhenStored(request.id, stored)

    def _publishBridged(self, request, payload):
        """
        A message from another broker's bridge (PROTOCOL.md, "Bridges"). It
        is acked even when this broker discards it as a copy: the bridge
        has nothing more to do with it.
        """
        self._checkBridgeable(request)
        options = request.options
        if options.get("retain") == "1" or options.get("to-matching") == "1":
            raise RequestError(
                BAD_ARGUMENTS,
                "a bridged message is neither retained nor published to-matching",
                request.id,
            )
        self.broker.publishBridged(
            self, request.topic, payload, originFromOptions(options), request.id
        )
        self.sendFrame(wire.encodePubAck(request.id))

    def _checkBridgeable(self, request):
        if not self.carriesBridges:
            raise RequestError(
                BAD_ARGUMENTS, "bridges connect over TCP, not this transport", request.id
            )
        self.broker.checkBridging(self, request.topic, request.id)

    def answerWhenStored(self, requestId, stored):
        """
        Ack a retained message once it is on disk, or refuse it if it could
        not be stored.

        @param stored: the Deferred of L{dallal.broker.core.Broker.retain}.
        """
        stored.addCallbacks(
            lambda _: self.sendFrame(wire.encodePubAck(requestId)), self._storeFailed
        )

    def _storeFailed(self, failure):
        failure.trap(RequestError)
        self.refuse(failure.value)

    def _handleSubscribe(self, request):
        options = request.options
        bridge = options.get("bridge") == "1"
        try:
            if bridge:
                self._checkBridgeable(request)
            subscription = self.broker.subscribe(
                self, request.topic, request.id, options.get("mode", LATEST), bridge
            )
        except RequestError as error:
            self.refuse(error)
            return
        self.sendFrame(wire.encodeSubAck(request.id))
        if bridge:
            # Its messages carry their origin; retained messages stay on
            # the broker they were published on.
            self.bridging = True
        else:
            self.broker.sendRetained(self, subscription)

    def _handleUnsubscribe(self, request):
        try:
            self.broker.unsubscribe(self, request.topic, request.id)
        except RequestError as error:
            self.refuse(error)
            return
        self.sendFrame(wire.encodeUnsubAck(request.id))

    def _handleAck(self, request):
        self.broker.acknowledge(self, request.deliveryId)

    def _sendData(self, verb, requestId, document):
        payload = json.dumps(document, sort_keys=True).encode("utf-8")
        self.sendFrame(*wire.encodeData(verb, requestId, payload))

    def _handleStats(self, request):
        self._sendData(b"STATS", request.id, self.broker.stats())

    def _handleList(self, request):
        subscriptions = self.broker.subscriptions(self)
        self._sendData(
            b"LIST",
            request.id,
            {
                "count": len(subscriptions),
                "subscriptions": [
                    {"filter": topicFilter, "mode": mode} for topicFilter, mode in subscriptions
                ],
            },
        )

    def _handleTopics(self, request):
        maxListed = self.broker.config.maxListed
        limit = wholeNumber(request.options.get("limit", str(maxListed)), 18)
        if limit is None:
            self.refuse(RequestError(BAD_ARGUMENTS, "limit must be a whole number", request.id))
            return
        rows, total = self.broker.topics(min(limit, maxListed))
        if total > maxListed and ("limit" not in request.options or limit > maxListed):
            # Cut by the broker's bound, not by what the client asked for.
            self.broker.refusedByLimit(self, LISTED, maxListed)
        self._sendData(
            b"TOPICS",
            request.id,
            {
                "total": total,
                "truncated": total > len(rows),
                "topics": [
                    {"topic": name, "retained_bytes": size, "subscribers": subscribers}
                    for name, size, subscribers in rows
                ],
            },
        )

    def _handlePing(self, request):
        self.sendFrame(wire.PONG_FRAME)

    def _handlePong(self, request):
        self.pongReceived()

    _requestHandlers = {
        wire.Subscribe: _handleSubscribe,
        wire.Unsubscribe: _handleUnsubscribe,
        wire.Ack: _handleAck,
        wire.ListSubscriptions: _handleList,
        wire.Topics: _handleTopics,
        wire.Stats: _handleStats,
        wire.Ping: _handlePing,
        wire.Pong: _handlePong,
    }
