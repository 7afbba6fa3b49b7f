"""
What a Dallal client does whatever carries its frames (L{dallal.client.tcp},
L{dallal.client.udp}).
"""

import itertools
import json
from collections import deque

from twisted.internet.defer import Deferred, fail, gatherResults, maybeDeferred, succeed
from twisted.internet.error import ConnectionDone
from twisted.logger import Logger

from dallal.client.errors import ClientProtocolError, ServerError
from dallal.client.pending import PendingRequests
from dallal.client.subscriptions import ReceivedMessage, SubscriptionState
from dallal.names import checkUserName
from dallal.numbers import wholeNumber
from dallal.protocol import wire

# ERR frames tied to no request kept for diagnostics, the latest ones.
SERVER_ERRORS_KEPT = 100


def _topicsReached(options):
    """
    The number of topics a PUBACK to a C{to-matching} publish says it reached.
    """
    reached = wholeNumber(options.get("topics", ""), 18)
    if reached is None:
        raise ClientProtocolError(f"unexpected answer to a to-matching publish: {options}")
    return reached


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


class ClientBase:
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
        self._pending = PendingRequests()
        self._ids = itertools.count(1)
        self._pingWaiters = []
        self._closeWaiters = []
        # Subscription id (its SUB's request id, the broker's sub=) -> its
        # SubscriptionState.
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
        self._pending.failAll(reason)
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
        return self._pending.take(requestId)

    def _sendRequest(self, requestId, frame):
        deferred = self._pending.add(requestId, self._takePending)
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
        return SubscriptionState(topic, onMessage, onGap, onEnded)

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
