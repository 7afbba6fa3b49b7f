"""
Delivery queues: what each subscriber has been sent, what waits, what is acked.

Every session has one L{Outbox}.  A subscription names its delivery mode:

 - C{latest} (the default): per subscription and topic, one message in
   flight until it is acked; a newer message on that topic waits, and a
   still newer one replaces the waiting one.  (A wildcard subscription
   matches many topics: each has its own slot.)
 - C{all}: every message is kept until acked, with at most C{maxInflight}
   unacked messages in flight per session and a bounded queue behind them.
 - C{fire}: sent once, never acked.

Whatever the mode, a session whose transport stops draining (the peer stops
reading) is paused: nothing more is written to it, and what arrives waits
here, within bounds.  When a bound is hit the slow-consumer policy decides:
C{drop-oldest} drops queued messages, C{disconnect} drops the session.

Each message offered to a subscription gets its next sequence number, so a
subscriber sees a gap where a message was replaced or dropped.  Every
message offered ends in exactly one of: acked, fired (sent in C{fire}
mode), replaced, dropped (with a reason), or still in flight; the counters
and events record which (docs/EVENTS.md).
"""

from collections import deque

from twisted.logger import LogLevel

from dallal.limits import QUEUED_BYTES, QUEUED_MESSAGES

LATEST = "latest"
ALL = "all"
FIRE = "fire"
MODES = (LATEST, ALL, FIRE)

DROP_OLDEST = "drop-oldest"
DISCONNECT = "disconnect"
SLOW_CONSUMER_POLICIES = (DROP_OLDEST, DISCONNECT)

# Why a message is dropped, as counted (dropped_<reason>) and logged.
QUEUE_FULL = "queue_full"
SLOW_CONSUMER = "slow_consumer"
DISCONNECTED = "disconnected"
REDELIVERY_LIMIT = "redelivery_limit"
SUPERSEDED = "superseded"
TOO_LARGE = "too_large"
BRIDGE_REFUSED = "bridge_refused"
DROP_REASONS = (
    QUEUE_FULL,
    SLOW_CONSUMER,
    DISCONNECTED,
    REDELIVERY_LIMIT,
    SUPERSEDED,
    TOO_LARGE,
    BRIDGE_REFUSED,
)


class Subscription:
    """
    One session's subscription to one topic.

    @ivar id: the client's id for it (its C{SUB} request id), sent back as
        C{sub=} on every message so the client knows which subscription and
        sequence a message belongs to.
    @ivar topic: its topic filter.
    @ivar latest: in C{latest} mode, topic -> L{_LatestSlot}, for the topics
        with a message in flight or waiting.
    @ivar bridge: whether it carries messages to another broker (a bridge's
        subscription), for the accounting of bridged traffic.
    """

    __slots__ = ("id", "topic", "mode", "outbox", "lastSeq", "latest", "bridge")

    def __init__(self, subscriptionId, topic, mode, outbox, bridge=False):
        self.id = subscriptionId
        self.topic = topic
        self.mode = mode
        self.outbox = outbox
        self.lastSeq = 0
        self.latest = {}
        self.bridge = bridge


class _LatestSlot:
    """
    C{latest} mode's state for one topic of one subscription: the delivery
    in flight, and the message waiting for it to be acked, as
    C{(message, seq)}; either may be C{None}.
    """

    __slots__ = ("inflight", "waiting")

    def __init__(self):
        self.inflight = None
        self.waiting = None


class _Delivery:
    """
    A message sent to a subscriber and not yet acked.
    """

    __slots__ = (
        "deliveryId",
        "subscription",
        "message",
        "seq",
        "attempt",
        "deadline",
        "windowed",
    )

    def __init__(self, deliveryId, subscription, message, seq):
        self.deliveryId = deliveryId
        self.subscription = subscription
        self.message = message
        self.seq = seq
        self.attempt = 1
        # When its ack is due, on the outbox's clock.
        self.deadline = None
        # Whether it holds one of the session's `all`-mode window slots (the
        # subscription's mode may change while it is in flight).
        self.windowed = subscription.mode == ALL


class DeliveryConfig:
    """
    The delivery limits of a broker, shared by every outbox of a transport.

    @ivar maxPayload: the largest payload the transport can carry to a
        subscriber, or C{None} for no limit beyond the broker's own: a UDP
        datagram carries less than the largest message a TCP client may
        publish.
    """

    __slots__ = (
        "maxInflight",
        "maxQueued",
        "maxQueuedBytes",
        "slowConsumer",
        "ackTimeout",
        "maxAttempts",
        "maxPayload",
    )

    def __init__(
        self,
        maxInflight=100,
        maxQueued=1000,
        maxQueuedBytes=8 * 1024 * 1024,
        slowConsumer=DROP_OLDEST,
        ackTimeout=10.0,
        maxAttempts=5,
        maxPayload=None,
    ):
        if slowConsumer not in SLOW_CONSUMER_POLICIES:
            raise ValueError(f"slow-consumer policy must be one of {SLOW_CONSUMER_POLICIES}")
        self.maxInflight = maxInflight
        self.maxQueued = maxQueued
        self.maxQueuedBytes = maxQueuedBytes
        self.slowConsumer = slowConsumer
        self.ackTimeout = ackTimeout
        self.maxAttempts = maxAttempts
        self.maxPayload = maxPayload

    def replace(self, **changes):
        """
        A copy with some limits changed.
        """
        limits = {name: getattr(self, name) for name in self.__slots__}
        limits.update(changes)
        return DeliveryConfig(**limits)


class Outbox:
    """
    The delivery state of one session.

    @param subscriber: the L{ISubscriber} that writes messages out.
    @param sid: the session's id, for events.
    @param ledger: the broker's L{Ledger}, which counts and logs.
    """

    def __init__(self, subscriber, sid, config, clock, ledger):
        self.subscriber = subscriber
        self.sid = sid
        self.config = config
        self.clock = clock
        self.ledger = ledger
        self.paused = False
        self.closed = False
        self._disconnecting = False
        self._nextDeliveryId = 1
        # Delivery id -> the delivery, in the order their acks are due: each
        # is (re)inserted when it is sent, due ackTimeout later.
        self._inflight = {}
        # One timer for the whole table, due when its oldest ack is: a timer
        # per delivery (a DelayedCall armed and cancelled for every message)
        # was 39% of the broker's CPU in `all` mode.
        self._ackTimer = None
        self._windowUsed = 0
        self._queue = deque()
        self._queuedBytes = 0
        # latest-mode subscriptions with a waiting message and nothing in
        # flight: what a resume must send.
        self._latestReady = []

    # From the broker

    def offer(self, subscription, message):
        """
        Deliver, queue or replace according to the subscription's mode.
        """
        subscription.lastSeq += 1
        seq = subscription.lastSeq
        self.ledger.matched(message)
        if self._disconnecting:
            self.ledger.dropped(self.sid, subscription, message, SLOW_CONSUMER)
            return
        maxPayload = self.config.maxPayload
        if maxPayload is not None and len(message.payload) > maxPayload:
            self.ledger.dropped(self.sid, subscription, message, TOO_LARGE)
            return
        mode = subscription.mode
        if mode == LATEST:
            self._offerLatest(subscription, message, seq)
        elif not self.paused and not self._queue and (
            mode == FIRE or self._windowUsed < self.config.maxInflight
        ):
            self._send(subscription, message, seq)
        else:
            self._enqueue(subscription, message, seq)

    def _offerLatest(self, subscription, message, seq):
        topic = message.topic
        slot = subscription.latest.get(topic)
        if slot is None:
            slot = subscription.latest[topic] = _LatestSlot()
        if slot.inflight is None and slot.waiting is None and not self.paused:
            self._send(subscription, message, seq)
            return
        if slot.waiting is not None:
            replaced, _ = slot.waiting
            self.ledger.replaced(self.sid, replaced, message)
        elif slot.inflight is None:
            self._latestReady.append((subscription, topic))
        slot.waiting = (message, seq)

    def _enqueue(self, subscription, message, seq):
        size = len(message.payload)
        config = self.config
        if len(self._queue) >= config.maxQueued:
            self.ledger.queueFull(self, QUEUED_MESSAGES, config.maxQueued)
        elif self._queuedBytes + size > config.maxQueuedBytes:
            self.ledger.queueFull(self, QUEUED_BYTES, config.maxQueuedBytes)
        if size > config.maxQueuedBytes:
            # It can never be queued: dropping what is queued would not help.
            if config.slowConsumer == DISCONNECT:
                self._disconnectSlowConsumer(subscription, message)
            else:
                self.ledger.dropped(self.sid, subscription, message, QUEUE_FULL)
            return
        while self._queue and (
            len(self._queue) >= config.maxQueued
            or self._queuedBytes + size > config.maxQueuedBytes
        ):
            if config.slowConsumer == DISCONNECT:
                self._disconnectSlowConsumer(subscription, message)
                return
            oldSubscription, oldMessage, _ = self._queue.popleft()
            self._queuedBytes -= len(oldMessage.payload)
            self.ledger.dropped(self.sid, oldSubscription, oldMessage, QUEUE_FULL)
        self._queue.append((subscription, message, seq))
        self._queuedBytes += size

    def _disconnectSlowConsumer(self, subscription, message):
        self.ledger.dropped(self.sid, subscription, message, SLOW_CONSUMER)
        # The transport closes asynchronously; until it has, whatever else
        # arrives for this session is dropped for the same reason.
        self._disconnecting = True
        self.subscriber.disconnect(SLOW_CONSUMER)

    def acknowledge(self, deliveryId):
        """
        The subscriber acked a delivery.  Unknown ids -- late, duplicate or
        made up -- are ignored.
        """
        delivery = self._inflight.pop(deliveryId, None)
        if delivery is None:
            return
        # The ack timer stays armed: when it fires it finds this delivery
        # gone and waits for the next one due.
        self.ledger.acked(self.sid, delivery.subscription, delivery.message)
        self._settled(delivery)

    def reject(self, deliveryId, reason):
        """
        The subscriber cannot take a delivery, for good: drop it for
        C{reason}.  Unknown ids are ignored, as acks are.
        """
        delivery = self._inflight.pop(deliveryId, None)
        if delivery is None:
            return
        # As for an ack, the timer finds it gone.
        self.ledger.dropped(self.sid, delivery.subscription, delivery.message, reason)
        self._settled(delivery)

    def pause(self):
        """
        The transport's buffer is full: write nothing more until L{resume}.
        """
        self.paused = True

    def resume(self):
        self.paused = False
        self._flush()

    def close(self, subscriptions):
        """
        The session ended: everything not yet acked is dropped.

        @param subscriptions: the session's subscriptions, whose waiting
            messages go too.
        """
        self.closed = True
        for subscription in subscriptions:
            self.unsubscribe(subscription)
        if self._ackTimer is not None and self._ackTimer.active():
            self._ackTimer.cancel()
        self._ackTimer = None
        for delivery in self._inflight.values():
            self.ledger.dropped(
                self.sid, delivery.subscription, delivery.message, DISCONNECTED
            )
        self._inflight.clear()
        for subscription, message, _ in self._queue:
            self.ledger.dropped(self.sid, subscription, message, DISCONNECTED)
        self._queue.clear()
        self._queuedBytes = 0
        self._latestReady = []

    def unsubscribe(self, subscription):
        """
        Drop what waits for C{subscription} in C{latest} mode: it will never
        be sent.  What is in flight may still be acked.
        """
        for slot in subscription.latest.values():
            if slot.waiting is not None:
                message, _ = slot.waiting
                slot.waiting = None
                self.ledger.dropped(self.sid, subscription, message, DISCONNECTED)

    # Sending

    def _send(self, subscription, message, seq):
        if subscription.mode == FIRE:
            self.ledger.fired(self.sid, subscription, message, seq)
            self.subscriber.sendMessage(message, subscription.id, seq, None, False)
            return
        deliveryId = str(self._nextDeliveryId)
        self._nextDeliveryId += 1
        delivery = _Delivery(deliveryId, subscription, message, seq)
        self._awaitAck(delivery)
        if delivery.windowed:
            self._windowUsed += 1
        else:
            # setdefault: a message queued in `all` mode may be sent after
            # the subscription switched to `latest`.
            subscription.latest.setdefault(message.topic, _LatestSlot()).inflight = delivery
        self.ledger.sent(self.sid, subscription, message, seq, 1)
        self.subscriber.sendMessage(message, subscription.id, seq, deliveryId, False)

    def _awaitAck(self, delivery):
        """
        Put C{delivery} at the end of the in-flight table, its ack due one
        ack timeout from now, and make sure the ack timer is armed.
        """
        delivery.deadline = self.clock.seconds() + self.config.ackTimeout
        # Re-inserting moves a delivery that was in the table to its end,
        # which keeps the table in the order of the deadlines.
        self._inflight.pop(delivery.deliveryId, None)
        self._inflight[delivery.deliveryId] = delivery
        if self._ackTimer is None:
            self._ackTimer = self.clock.callLater(
                self.config.ackTimeout, self._checkAckDeadlines
            )

    def _checkAckDeadlines(self):
        """
        The ack timer fired: deal with every delivery whose ack is overdue,
        oldest first, then arm the timer for the next one due.
        """
        # The timer stays set while the overdue are dealt with, so that
        # their resends do not arm another one.
        now = self.clock.seconds()
        overdue = []
        for delivery in self._inflight.values():
            if delivery.deadline > now:
                break
            overdue.append(delivery)
        for delivery in overdue:
            # Dealing with one may have closed the outbox (its connection lost).
            if self._inflight.get(delivery.deliveryId) is delivery:
                self._ackTimedOut(delivery)
        self._ackTimer = None
        if self._inflight and not self.closed:
            oldest = next(iter(self._inflight.values()))
            self._ackTimer = self.clock.callLater(
                max(0.0, oldest.deadline - now), self._checkAckDeadlines
            )

    def _settled(self, delivery):
        """
        A delivery left the in-flight table: free its slot and send what it
        was holding back.
        """
        if delivery.windowed:
            self._windowUsed -= 1
        else:
            subscription = delivery.subscription
            topic = delivery.message.topic
            slot = subscription.latest[topic]
            if slot.inflight is delivery:
                slot.inflight = None
            if slot.inflight is None and slot.waiting is None:
                del subscription.latest[topic]
            else:
                self._latestReady.append((subscription, topic))
        self._flush()

    def _flush(self):
        """
        Send what waits, as far as the transport and the window allow.
        """
        if self.closed:
            return
        ready, self._latestReady = self._latestReady, []
        for subscription, topic in ready:
            slot = subscription.latest.get(topic)
            if slot is None or slot.waiting is None:
                continue
            if self.paused or slot.inflight is not None:
                self._latestReady.append((subscription, topic))
            else:
                message, seq = slot.waiting
                slot.waiting = None
                self._send(subscription, message, seq)
        queue = self._queue
        while queue and not self.paused:
            subscription, message, seq = queue[0]
            if subscription.mode == ALL and self._windowUsed >= self.config.maxInflight:
                break
            queue.popleft()
            self._queuedBytes -= len(message.payload)
            self._send(subscription, message, seq)

    def _ackTimedOut(self, delivery):
        subscription = delivery.subscription
        slot = None if delivery.windowed else subscription.latest.get(delivery.message.topic)
        if slot is not None and slot.waiting is not None:
            # A newer message supersedes the unacked one instead of a resend.
            del self._inflight[delivery.deliveryId]
            self.ledger.dropped(self.sid, subscription, delivery.message, SUPERSEDED)
            self._settled(delivery)
            return
        if self.paused:
            # The peer is not reading: resending would only pile bytes onto
            # the same stalled connection.  Try again later, same attempt.
            self._awaitAck(delivery)
            return
        if delivery.attempt >= self.config.maxAttempts:
            del self._inflight[delivery.deliveryId]
            self.ledger.dropped(self.sid, subscription, delivery.message, REDELIVERY_LIMIT)
            self._settled(delivery)
            return
        delivery.attempt += 1
        self.ledger.sent(self.sid, subscription, delivery.message, delivery.seq, delivery.attempt)
        self.subscriber.sendMessage(
            delivery.message, subscription.id, delivery.seq, delivery.deliveryId, True
        )
        self._awaitAck(delivery)


# The counters the ledger keeps (docs/EVENTS.md describes them).
DELIVERY_COUNTERS = (
    "matched",
    "delivered",
    "fired",
    "redelivered",
    "acked",
    "replaced",
    "dropped",
    "inflight",
    "bridged_delivered",
    "bridged_dropped",
    *("dropped_" + reason for reason in DROP_REASONS),
)


class Ledger:
    """
    The broker's accounting of deliveries: counters and per-message events.

    Every message offered to a subscription is counted as C{matched} and
    C{inflight}; it leaves C{inflight} exactly once, as acked, fired,
    replaced or dropped.
    """

    def __init__(self, counters, events, limits, topicTraffic):
        """
        @param limits: the broker's L{dallal.limits.LimitLog}, which a full
            queue reports to.
        @param topicTraffic: the broker's L{dallal.sysstats.TopicTraffic},
            which counts what is sent per topic.
        """
        self.counters = counters
        self.events = events
        self.limits = limits
        self.topicTraffic = topicTraffic
        for name in DELIVERY_COUNTERS:
            counters[name] = 0

    def matched(self, message):
        self.counters["matched"] += 1
        self.counters["inflight"] += 1

    def sent(self, sid, subscription, message, seq, attempt):
        counters = self.counters
        counters["bytes_out"] += len(message.payload)
        self.topicTraffic.sent(message.topic, len(message.payload), attempt == 1)
        if attempt == 1:
            counters["delivered"] += 1
            if subscription.bridge:
                counters["bridged_delivered"] += 1
        else:
            counters["redelivered"] += 1
        events = self.events
        if events.messageEvents:
            events.emit(
                "deliver",
                mid=message.mid,
                topic=message.topic,
                session=sid,
                client=subscription.outbox.subscriber.peer,
                mode=subscription.mode,
                seq=seq,
                attempt=attempt,
            )

    def fired(self, sid, subscription, message, seq):
        self.sent(sid, subscription, message, seq, 1)
        self.counters["fired"] += 1
        self.counters["inflight"] -= 1

    def acked(self, sid, subscription, message):
        self.counters["acked"] += 1
        self.counters["inflight"] -= 1
        events = self.events
        if events.messageEvents:
            events.emit(
                "ack",
                mid=message.mid,
                topic=message.topic,
                session=sid,
                latency=round(subscription.outbox.clock.seconds() - message.published, 6),
            )

    def replaced(self, sid, message, newer):
        self.counters["replaced"] += 1
        self.counters["inflight"] -= 1
        events = self.events
        if events.messageEvents:
            events.emit(
                "replace", mid=message.mid, topic=message.topic, session=sid, by=newer.mid
            )

    def queueFull(self, outbox, limit, maximum):
        """
        A message met a session's full queue: C{limit} is the bound it hit.
        """
        subscriber = outbox.subscriber
        self.limits.refused(
            limit, maximum, subscriber.peer, subscriber.transportName, outbox.sid
        )

    def dropped(self, sid, subscription, message, reason):
        counters = self.counters
        counters["dropped"] += 1
        counters["dropped_" + reason] += 1
        counters["inflight"] -= 1
        if subscription.bridge:
            counters["bridged_dropped"] += 1
        events = self.events
        if events.messageEvents:
            events.emit(
                "drop",
                LogLevel.warn,
                mid=message.mid,
                topic=message.topic,
                session=sid,
                reason=reason,
            )
