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
here, within bounds.  When a message meets a full queue (modes C{all} and
C{fire}), its publisher is held back (L{FlowControl}): the queue takes it,
one beyond its bound, and the publishing session reads nothing more until
the queue has drained to half its bounds.  Only a subscriber that makes no
progress (no ack, no drained transport) for C{stallTimeout} while it holds
publishers back is a slow consumer: then the slow-consumer policy decides,
C{drop-oldest} drops queued messages, C{disconnect} drops the session, and
the publishers it held resume.  A message nothing can hold back (published
by the subscriber's own session, or by the broker itself) meets a full
queue with the policy at once.

Each message offered to a subscription gets its next sequence number, so a
subscriber sees a gap where a message was replaced or dropped.  Every
message offered ends in exactly one of: acked, fired (sent in C{fire}
mode), replaced, dropped (with a reason), or still in flight; the counters
and events record which (docs/EVENTS.md).
"""

from collections import deque

from twisted.logger import LogLevel

from dallal.broker.counters import (
    DISCONNECTED,
    QUEUE_FULL,
    REDELIVERY_LIMIT,
    SLOW_CONSUMER,
    SUPERSEDED,
    TOO_LARGE,
)
from dallal.limits import QUEUED_BYTES, QUEUED_MESSAGES
from dallal.modes import ALL, FIRE, LATEST

DROP_OLDEST = "drop-oldest"
DISCONNECT = "disconnect"
SLOW_CONSUMER_POLICIES = (DROP_OLDEST, DISCONNECT)


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
    @ivar retainedFeed: the L{dallal.broker.feed.RetainedFeed} of the
        retained messages still waiting to be offered, or C{None}.
    """

    __slots__ = ("id", "topic", "mode", "outbox", "lastSeq", "latest", "bridge", "retainedFeed")

    def __init__(self, subscriptionId, topic, mode, outbox, bridge=False):
        self.id = subscriptionId
        self.topic = topic
        self.mode = mode
        self.outbox = outbox
        self.lastSeq = 0
        self.latest = {}
        self.bridge = bridge
        self.retainedFeed = None


class _LatestSlot:
    """
    C{latest} mode's state for one topic of one subscription: the id of the
    delivery in flight, and the message waiting for it to be acked, as
    C{(message, seq)}; either may be C{None}.
    """

    __slots__ = ("inflight", "waiting")

    def __init__(self):
        self.inflight = None
        self.waiting = None


class DeliveryConfig:
    """
    The delivery limits of a broker, shared by every outbox of a transport.

    @ivar maxPayload: the largest payload the transport can carry to a
        subscriber, or C{None} for no limit beyond the broker's own: a UDP
        datagram carries less than the largest message a TCP client may
        publish.
    @ivar stallTimeout: seconds a subscriber whose queue is full may make
        no progress before it is a slow consumer.
    @ivar ackTimeout: seconds before an unacked message is sent again, or
        C{None} for a transport that never resends within a session.
    """

    __slots__ = (
        "maxInflight",
        "maxQueued",
        "maxQueuedBytes",
        "slowConsumer",
        "ackTimeout",
        "maxAttempts",
        "maxPayload",
        "stallTimeout",
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
        stallTimeout=5.0,
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
        self.stallTimeout = stallTimeout

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
    @param flow: the broker's L{FlowControl}, which holds publishers back.
    @ivar holding: the publishing sessions this outbox holds back (as keys).
    @ivar stalled: whether its subscriber made no progress for the stall
        timeout with a full queue: until it makes some, a full queue drops
        or disconnects instead of holding publishers back.
    """

    def __init__(self, subscriber, sid, config, clock, ledger, flow):
        self.subscriber = subscriber
        self.sid = sid
        self.config = config
        self.clock = clock
        self.ledger = ledger
        self.flow = flow
        # A dict, for the order: publishers go on in the order they were held.
        self.holding = {}
        self.stalled = False
        # While publishers are held back: when the subscriber last made
        # progress (or the hold began), and the timer that looks for a stall.
        self._lastProgress = None
        self._stallTimer = None
        self.paused = False
        self.closed = False
        self._disconnecting = False
        self._nextDeliveryId = 1
        # Delivery id -> the delivery sent and not yet acked, in the order
        # their acks are due: each is (re)inserted when it is sent, due
        # ackTimeout later.  A delivery is a tuple (a message in flight
        # costs no object of its own): (subscription, message, seq,
        # attempt, deadline -- when its ack is due on the outbox's clock,
        # or None --, windowed -- whether it holds one of the session's
        # `all`-mode window slots: the subscription's mode may change while
        # it is in flight).
        self._inflight = {}
        # One timer for the whole table, due when its oldest ack is: a timer
        # per delivery would arm and cancel a DelayedCall for every message,
        # the largest single cost of `all` mode.
        self._ackTimer = None
        self._windowUsed = 0
        self._queue = deque()
        self._queuedBytes = 0
        # latest-mode subscriptions with a waiting message and nothing in
        # flight: what a resume must send.
        self._latestReady = []
        # Called on the next turn once the outbox has room (L{whenRoom}).
        self._roomWaiters = []

    # From the broker

    def offer(self, subscription, message, publisher=None):
        """
        Deliver, queue or replace according to the subscription's mode.

        @param publisher: the session that published it, to hold back if
            the queue is full; C{None} if nothing can be held back (the
            subscriber's own session, the broker itself).
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
        elif (
            not self.paused
            and not self._queue
            and (mode == FIRE or self._windowUsed < self.config.maxInflight)
        ):
            self._send(subscription, message, seq)
        else:
            self._enqueue(subscription, message, seq, publisher)

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

    def _enqueue(self, subscription, message, seq, publisher):
        size = len(message.payload)
        config = self.config
        bound = self._boundMet(size)
        if bound is not None:
            if publisher is not None and not self.stalled and size <= config.maxQueuedBytes:
                # Backpressure: the publisher stops, and this one message
                # goes beyond the bound (about one per publisher at most).
                self._queue.append((subscription, message, seq))
                self._queuedBytes += size
                self._hold(publisher)
                return
            self.ledger.queueFull(self, *bound)
        if size > config.maxQueuedBytes:
            # It can never be queued: dropping what is queued would not help.
            if config.slowConsumer == DISCONNECT:
                self._disconnectSlowConsumer(subscription, message)
            else:
                self.ledger.dropped(self.sid, subscription, message, QUEUE_FULL)
            return
        while self._queue and (
            len(self._queue) >= config.maxQueued or self._queuedBytes + size > config.maxQueuedBytes
        ):
            if config.slowConsumer == DISCONNECT:
                self._disconnectSlowConsumer(subscription, message)
                return
            oldSubscription, oldMessage, _ = self._queue.popleft()
            self._queuedBytes -= len(oldMessage.payload)
            self.ledger.dropped(self.sid, oldSubscription, oldMessage, QUEUE_FULL)
        self._queue.append((subscription, message, seq))
        self._queuedBytes += size

    def _boundMet(self, size):
        """
        The bound a message of C{size} payload bytes would break if queued,
        as C{(limit, maximum)}; C{None} if it fits.
        """
        config = self.config
        if len(self._queue) >= config.maxQueued:
            return QUEUED_MESSAGES, config.maxQueued
        if self._queuedBytes + size > config.maxQueuedBytes:
            return QUEUED_BYTES, config.maxQueuedBytes
        return None

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
        if self.holding or self.stalled:
            self._progressed()
        # The ack timer stays armed: when it fires it finds this delivery
        # gone and waits for the next one due.
        subscription, message, _, _, _, windowed = delivery
        self.ledger.acked(self.sid, subscription, message)
        self._settled(deliveryId, subscription, message, windowed)

    def acknowledgeAll(self, deliveryIds):
        """
        The subscriber acked deliveries one after the other: as many
        L{acknowledge}s, what they held back sent once.
        """
        inflight = self._inflight
        acked = []
        for deliveryId in deliveryIds:
            delivery = inflight.pop(deliveryId, None)
            if delivery is not None:
                acked.append((deliveryId, delivery))
        if not acked:
            return
        if self.holding or self.stalled:
            self._progressed()
        self.ledger.ackedTogether(self.sid, acked)
        for deliveryId, (subscription, message, _, _, _, windowed) in acked:
            self._freeSlot(deliveryId, subscription, message, windowed)
        self._flush()

    def reject(self, deliveryId, reason):
        """
        The subscriber cannot take a delivery, for good: drop it for
        C{reason}.  Unknown ids are ignored, as acks are.
        """
        delivery = self._inflight.pop(deliveryId, None)
        if delivery is None:
            return
        if self.holding or self.stalled:
            self._progressed()
        # As for an ack, the timer finds it gone.
        subscription, message, _, _, _, windowed = delivery
        self.ledger.dropped(self.sid, subscription, message, reason)
        self._settled(deliveryId, subscription, message, windowed)

    def pause(self):
        """
        The transport's buffer is full: write nothing more until L{resume}.
        """
        self.paused = True

    def setWindow(self, maxInflight):
        """
        From now on at most C{maxInflight} C{all}-mode messages await their
        ack; a wider window sends at once what waited for room in it.
        """
        self.config = self.config.replace(maxInflight=maxInflight)
        self._flush()

    def resume(self):
        """
        The transport's buffer drained: send what waits.
        """
        self.paused = False
        if (self.holding or self.stalled) and self._windowUsed < self.config.maxInflight:
            # Progress, unless acks are what the queue waits for: then only
            # they are (a peer that reads nothing still drains for a while,
            # into the kernel's buffers as they grow).
            self._progressed()
        self._flush()

    # Room for what the broker offers of itself (a new subscription's
    # retained messages, dallal.broker.feed): it waits for the subscriber,
    # as a held publisher does, but never goes beyond the bounds.

    def hasRoom(self):
        """
        Whether a message offered now is sent, or waits within half the
        queue's bounds: the transport takes what is written, and no more
        than C{maxInflight} messages await their ack.
        """
        config = self.config
        # Half the bounds, rounded up: a queue of one has room for one.
        halfQueued = config.maxQueued - config.maxQueued // 2
        return (
            not (self.paused or self.closed or self._disconnecting)
            and len(self._inflight) <= config.maxInflight
            and len(self._latestReady) < halfQueued
            and len(self._queue) < halfQueued
            and self._queuedBytes < config.maxQueuedBytes - config.maxQueuedBytes // 2
        )

    def whenRoom(self, callback):
        """
        Call C{callback()} on a turn of the clock after this outbox has
        room again; never if it closes first.
        """
        self._roomWaiters.append(callback)

    def _callRoomWaiters(self):
        waiters, self._roomWaiters = self._roomWaiters, []
        for callback in waiters:
            self.clock.callLater(0, callback)

    # Backpressure

    def _hold(self, publisher):
        """
        The queue is full: hold C{publisher} back, and watch that the
        subscriber keeps making progress.
        """
        if self._stallTimer is None:
            self._lastProgress = self.clock.seconds()
            self._stallTimer = self.clock.callLater(self.config.stallTimeout, self._checkStall)
        self.flow.hold(publisher, self)

    def _progressed(self):
        """
        The subscriber acked, or its transport drained.
        """
        self.stalled = False
        if self._stallTimer is not None:
            self._lastProgress = self.clock.seconds()

    def _belowLowWater(self):
        config = self.config
        return (
            len(self._queue) <= config.maxQueued // 2
            and self._queuedBytes <= config.maxQueuedBytes // 2
        )

    def _releasePublishers(self):
        """
        Stop holding publishers back, and stop watching for a stall.
        """
        if self._stallTimer is not None:
            if self._stallTimer.active():
                self._stallTimer.cancel()
            self._stallTimer = None
        self.flow.release(self)

    def _checkStall(self):
        """
        The stall timer fired: a subscriber that made no progress for the
        stall timeout is a slow consumer; one that did is given as long
        again from its last progress.
        """
        self._stallTimer = None
        if not self.holding:
            return
        now = self.clock.seconds()
        due = self._lastProgress + self.config.stallTimeout
        if now < due:
            self._stallTimer = self.clock.callLater(due - now, self._checkStall)
            return
        self.stalled = True
        self.ledger.slowConsumer(self, now - self._lastProgress, len(self._queue))
        self._releasePublishers()
        config = self.config
        if config.slowConsumer == DISCONNECT:
            self._disconnecting = True
            self.subscriber.disconnect(SLOW_CONSUMER)
            return
        # What went beyond the bounds while publishers were held.
        queue = self._queue
        while len(queue) > config.maxQueued or self._queuedBytes > config.maxQueuedBytes:
            self.ledger.queueFull(self, *self._boundMet(0))
            subscription, message, _ = queue.popleft()
            self._queuedBytes -= len(message.payload)
            self.ledger.dropped(self.sid, subscription, message, QUEUE_FULL)

    def close(self, subscriptions):
        """
        The session ended: everything not yet acked is dropped.

        @param subscriptions: the session's subscriptions, whose waiting
            messages go too.
        """
        self.closed = True
        self._releasePublishers()
        self._roomWaiters = []
        for subscription in subscriptions:
            self.unsubscribe(subscription)
        if self._ackTimer is not None and self._ackTimer.active():
            self._ackTimer.cancel()
        self._ackTimer = None
        for subscription, message, _, _, _, _ in self._inflight.values():
            self.ledger.dropped(self.sid, subscription, message, DISCONNECTED)
        self._inflight.clear()
        for subscription, message, _ in self._queue:
            self.ledger.dropped(self.sid, subscription, message, DISCONNECTED)
        self._queue.clear()
        self._queuedBytes = 0
        self._latestReady = []

    def unsubscribe(self, subscription):
        """
        Drop what waits for C{subscription} in C{latest} mode, and stop
        offering it retained messages: they will never be sent.  What is
        in flight may still be acked.
        """
        if subscription.retainedFeed is not None:
            subscription.retainedFeed.stop()
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
        self.ledger.sent(self.sid, subscription, message, seq, 1)
        self._sendAcked(subscription, message, seq)

    def _sendAcked(self, subscription, message, seq):
        """
        Send a message to be acked, as its first attempt, counted already
        (L{Ledger.sent}).
        """
        deliveryId = str(self._nextDeliveryId)
        self._nextDeliveryId += 1
        windowed = subscription.mode == ALL
        self._awaitAck(deliveryId, (subscription, message, seq, 1, windowed))
        if windowed:
            self._windowUsed += 1
        else:
            # setdefault: a message queued in `all` mode may be sent after
            # the subscription switched to `latest`.
            subscription.latest.setdefault(message.topic, _LatestSlot()).inflight = deliveryId
        self.subscriber.sendMessage(message, subscription.id, seq, deliveryId, False)

    def _awaitAck(self, deliveryId, sent, again=False):
        """
        Put a delivery at the end of the in-flight table, its ack due one
        ack timeout from now, and make sure the ack timer is armed.

        @param sent: the delivery without its deadline: C{(subscription,
            message, seq, attempt, windowed)}.
        @param again: whether it is in the table already (its ack timed out).
        """
        subscription, message, seq, attempt, windowed = sent
        ackTimeout = self.config.ackTimeout
        if ackTimeout is None:
            # The transport resends nothing within a session (MQTT): the
            # delivery waits for its ack for as long as the session lasts.
            self._inflight[deliveryId] = (subscription, message, seq, attempt, None, windowed)
            return
        deadline = self.clock.seconds() + ackTimeout
        if again:
            # Re-inserting moves it to the end of the table, which keeps
            # the table in the order of the deadlines.
            self._inflight.pop(deliveryId, None)
        self._inflight[deliveryId] = (subscription, message, seq, attempt, deadline, windowed)
        if self._ackTimer is None:
            self._ackTimer = self.clock.callLater(ackTimeout, self._checkAckDeadlines)

    def _checkAckDeadlines(self):
        """
        The ack timer fired: deal with every delivery whose ack is overdue,
        oldest first, then arm the timer for the next one due.
        """
        # The timer stays set while the overdue are dealt with, so that
        # their resends do not arm another one.
        now = self.clock.seconds()
        overdue = []
        for deliveryId, delivery in self._inflight.items():
            if delivery[4] > now:
                break
            overdue.append((deliveryId, delivery))
        for deliveryId, delivery in overdue:
            # Dealing with one may have closed the outbox (its connection lost).
            if self._inflight.get(deliveryId) is delivery:
                self._ackTimedOut(deliveryId, delivery)
        self._ackTimer = None
        if self._inflight and not self.closed:
            oldestDeadline = next(iter(self._inflight.values()))[4]
            self._ackTimer = self.clock.callLater(
                max(0.0, oldestDeadline - now), self._checkAckDeadlines
            )

    def _settled(self, deliveryId, subscription, message, windowed):
        """
        A delivery left the in-flight table: free its slot and send what it
        was holding back.
        """
        self._freeSlot(deliveryId, subscription, message, windowed)
        self._flush()

    def _freeSlot(self, deliveryId, subscription, message, windowed):
        """
        A delivery left the in-flight table: free its place in the window,
        or its C{latest}-mode slot.
        """
        if windowed:
            self._windowUsed -= 1
        else:
            topic = message.topic
            slot = subscription.latest[topic]
            if slot.inflight == deliveryId:
                slot.inflight = None
            if slot.inflight is None and slot.waiting is None:
                del subscription.latest[topic]
            else:
                self._latestReady.append((subscription, topic))

    def _flush(self):
        """
        Send what waits, as far as the transport and the window allow.
        """
        if self.closed:
            return
        if self._latestReady:
            self._flushLatest()
        queue = self._queue
        eachOnItsOwn = self.ledger.events.messageEvents
        # A run of messages on one topic in one mode, fire or all, is
        # counted together.
        runTopic = runMode = None
        runLength = runBytes = runBridged = 0
        while queue and not self.paused:
            subscription, message, seq = queue[0]
            mode = subscription.mode
            if mode == ALL and self._windowUsed >= self.config.maxInflight:
                break
            queue.popleft()
            size = len(message.payload)
            self._queuedBytes -= size
            if mode == LATEST or eachOnItsOwn:
                self._send(subscription, message, seq)
                continue
            if message.topic != runTopic or mode != runMode:
                if runLength:
                    self._countRun(runMode, runTopic, runLength, runBytes, runBridged)
                runTopic = message.topic
                runMode = mode
                runLength = runBytes = runBridged = 0
            runLength += 1
            runBytes += size
            runBridged += subscription.bridge
            if mode == FIRE:
                self.subscriber.sendMessage(message, subscription.id, seq, None, False)
            else:
                self._sendAcked(subscription, message, seq)
        if runLength:
            self._countRun(runMode, runTopic, runLength, runBytes, runBridged)
        if self.holding and self._belowLowWater():
            self._releasePublishers()
        if self._roomWaiters and self.hasRoom():
            self._callRoomWaiters()

    def _countRun(self, mode, topic, deliveries, size, bridged):
        """
        Count a run of queued messages on C{topic} sent in C{mode}: fired,
        or delivered and in flight until acked.
        """
        if mode == FIRE:
            self.ledger.firedTogether(topic, deliveries, size, bridged, offered=False)
        else:
            self.ledger.sentTogether(topic, deliveries, size, bridged, offered=False)

    def _flushLatest(self):
        """
        Send the C{latest}-mode messages that wait for nothing more.
        """
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

    def _ackTimedOut(self, deliveryId, delivery):
        subscription, message, seq, attempt, _, windowed = delivery
        slot = None if windowed else subscription.latest.get(message.topic)
        if slot is not None and slot.waiting is not None:
            # A newer message supersedes the unacked one instead of a resend.
            del self._inflight[deliveryId]
            self.ledger.dropped(self.sid, subscription, message, SUPERSEDED)
            self._settled(deliveryId, subscription, message, windowed)
            return
        if self.paused:
            # The peer is not reading: resending would only pile bytes onto
            # the same stalled connection.  Try again later, same attempt.
            self._awaitAck(deliveryId, (subscription, message, seq, attempt, windowed), True)
            return
        if attempt >= self.config.maxAttempts:
            del self._inflight[deliveryId]
            self.ledger.dropped(self.sid, subscription, message, REDELIVERY_LIMIT)
            self._settled(deliveryId, subscription, message, windowed)
            return
        attempt += 1
        self.ledger.sent(self.sid, subscription, message, seq, attempt)
        self.subscriber.sendMessage(message, subscription.id, seq, deliveryId, True)
        self._awaitAck(deliveryId, (subscription, message, seq, attempt, windowed), True)


def firesAtOnce(subscription, publisher):
    """
    Whether a message offered to C{subscription} now would be written at
    once, in C{fire} mode, by L{offerToEach}'s first case, and by a
    subscriber that takes runs of messages now
    (L{dallal.broker.interfaces.IRunSubscriber}): a live
    subscription of another session than C{publisher}'s, whose outbox is
    neither paused nor queueing nor bound by a transport's payload limit,
    with no retained messages still to offer.
    """
    outbox = subscription.outbox
    return (
        subscription.__class__ is Subscription
        and subscription.mode == FIRE
        and subscription.retainedFeed is None
        and outbox.subscriber is not publisher
        and not outbox._disconnecting
        and not outbox.paused
        and not outbox._queue
        and outbox.config.maxPayload is None
        and getattr(outbox.subscriber, "takesRuns", False)
    )


def offerToEach(receivers, message, publisher, ledger):
    """
    Offer a new message to each of the subscriptions it goes to, as
    L{Outbox.offer} would one by one.

    The firehose's common cases are done here, without the per-delivery
    calls: a C{fire} subscription whose outbox sends at once (not paused,
    nothing queued, the payload within the transport's limit) is sent the
    message, and one whose outbox is paused or queueing has it queued if
    the queue is within its bounds.  So is an C{all} subscription whose
    outbox sends at once, with room in its window: the message is sent,
    in flight until acked.  Those deliveries of the message are counted
    together (L{Ledger.firedTogether}, L{Ledger.queuedTogether},
    L{Ledger.sentTogether}).
    With per-message events on, every delivery goes through
    L{Outbox.offer}, which logs each.

    @param receivers: L{Subscription}s, or share groups (which offer the
        message to one member themselves).
    @param publisher: the publishing session, which a full queue holds back
        (never from its own outbox); C{None} for the broker's own messages.
    @param ledger: the L{Ledger} of the receivers' outboxes.
    """
    topic = message.topic
    size = len(message.payload)
    eachOnItsOwn = ledger.events.messageEvents
    fired = queued = bridged = sent = sentBridged = 0
    for subscription in receivers:
        if subscription.retainedFeed is not None:
            subscription.retainedFeed.before(topic)
        outbox = subscription.outbox
        if (
            not eachOnItsOwn
            and subscription.__class__ is Subscription
            and not outbox._disconnecting
        ):
            mode = subscription.mode
            config = outbox.config
            withinPayload = config.maxPayload is None or size <= config.maxPayload
            if mode == FIRE and withinPayload:
                queue = outbox._queue
                if not outbox.paused and not queue:
                    subscription.lastSeq += 1
                    fired += 1
                    bridged += subscription.bridge
                    outbox.subscriber.sendMessage(
                        message, subscription.id, subscription.lastSeq, None, False
                    )
                    continue
                if len(queue) < config.maxQueued and outbox._queuedBytes + size <= (
                    config.maxQueuedBytes
                ):
                    subscription.lastSeq += 1
                    queued += 1
                    queue.append((subscription, message, subscription.lastSeq))
                    outbox._queuedBytes += size
                    continue
            elif (
                mode == ALL
                and withinPayload
                and not (outbox.paused or outbox._queue)
                and outbox._windowUsed < config.maxInflight
            ):
                subscription.lastSeq += 1
                sent += 1
                sentBridged += subscription.bridge
                outbox._sendAcked(subscription, message, subscription.lastSeq)
                continue
        outbox.offer(subscription, message, None if outbox.subscriber is publisher else publisher)
    if fired:
        ledger.firedTogether(topic, fired, size * fired, bridged, offered=True)
    if queued:
        ledger.queuedTogether(queued)
    if sent:
        ledger.sentTogether(topic, sent, size * sent, sentBridged, offered=True)


class FlowControl:
    """
    Which publishing sessions are held back, and by which outboxes.

    A session is held back while any outbox holds it (L{Outbox.holding}):
    it is told to stop publishing (C{pausePublishing}: a TCP connection
    stops reading, a UDP session answers C{BUSY}) when the first one holds
    it, and to go on (C{resumePublishing}) once the last one lets it go.
    The resumes are made on the clock's next turn, never from inside the
    outbox whose draining let them go: a resumed TCP connection at once
    reads what it had buffered, which publishes to that outbox again.
    """

    def __init__(self, clock, counters):
        """
        @param counters: the broker's L{dallal.broker.counters.Counters}.
        """
        self.clock = clock
        self.counters = counters
        # publisher -> the outboxes holding it back.
        self._heldBy = {}
        # Publishers let go whose resume is due (a dict: in order).
        self._resuming = {}
        self._resumeCall = None

    def hold(self, publisher, outbox):
        holders = self._heldBy.get(publisher)
        if holders is None:
            holders = self._heldBy[publisher] = set()
            self.counters.publisherHeld()
            # One let go and held again before its resume was made is
            # still paused.
            if self._resuming.pop(publisher, None) is None:
                publisher.pausePublishing()
        holders.add(outbox)
        outbox.holding[publisher] = True

    def release(self, outbox):
        """
        C{outbox} holds nobody back any more.
        """
        holding, outbox.holding = outbox.holding, {}
        for publisher in holding:
            holders = self._heldBy.get(publisher)
            if holders is None:
                continue
            holders.discard(outbox)
            if not holders:
                del self._heldBy[publisher]
                self.counters.publisherReleased()
                self._resuming[publisher] = True
        if self._resuming and self._resumeCall is None:
            self._resumeCall = self.clock.callLater(0, self._resume)

    def _resume(self):
        self._resumeCall = None
        resuming, self._resuming = self._resuming, {}
        for publisher in resuming:
            publisher.resumePublishing()

    def forget(self, publisher):
        """
        C{publisher}'s session ended: nothing holds it back any more.
        """
        self._resuming.pop(publisher, None)
        holders = self._heldBy.pop(publisher, None)
        if holders is not None:
            self.counters.publisherReleased()
            for outbox in holders:
                outbox.holding.pop(publisher, None)


class Ledger:
    """
    The broker's accounting of deliveries: what it reports to the
    counters, and the per-message events.

    Every message offered to a subscription is counted as C{matched} and
    C{inflight}; it leaves C{inflight} exactly once, as acked, fired,
    replaced or dropped.
    """

    def __init__(self, counters, events, limits, topicTraffic):
        """
        @param counters: the broker's L{dallal.broker.counters.Counters}.
        @param limits: the broker's L{dallal.limits.LimitLog}, which a full
            queue reports to.
        @param topicTraffic: the broker's L{dallal.broker.sysstats.TopicTraffic},
            which counts what is sent per topic.
        """
        self.counters = counters
        self.events = events
        self.limits = limits
        self.topicTraffic = topicTraffic

    def matched(self, message):
        self.counters.matched()

    def sent(self, sid, subscription, message, seq, attempt):
        size = len(message.payload)
        first = attempt == 1
        self.counters.sent(size, first, subscription.bridge)
        self.topicTraffic.sent(message.topic, size, first)
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
        self.counters.settled("fired")

    def firedTogether(self, topic, deliveries, size, bridged, offered):
        """
        C{deliveries} messages on C{topic}, C{size} payload bytes in all,
        were sent in C{fire} mode, C{bridged} of them to bridges: counted
        together, delivered and fired, as many L{fired} would.  Only with
        per-message events off: then nothing is logged per delivery.

        @param offered: whether they were sent as they were offered
            (L{offerToEach}), and are counted as matched now; else they
            waited in a queue, matched and in flight (L{queuedTogether}).
        """
        self.counters.firedTogether(deliveries, size, bridged, offered)
        self.topicTraffic.sent(topic, size, deliveries)

    def sentTogether(self, topic, deliveries, size, bridged, offered):
        """
        C{deliveries} messages on C{topic}, C{size} payload bytes in all,
        were sent to be acked, C{bridged} of them to bridges: counted
        together, delivered and in flight, as many L{sent} would.  Only
        with per-message events off.

        @param offered: whether they were sent as they were offered
            (L{offerToEach}), and are counted as matched now; else they
            waited in a queue, matched and in flight already.
        """
        self.counters.sentTogether(deliveries, size, bridged, offered)
        self.topicTraffic.sent(topic, size, deliveries)

    def queuedTogether(self, deliveries):
        """
        A message was queued for C{deliveries} subscriptions at once
        (L{offerToEach}): each is matched, and in flight until it is fired
        or dropped.
        """
        self.counters.matched(deliveries)

    def acked(self, sid, subscription, message):
        self.counters.settled("acked")
        if self.events.messageEvents:
            self._ackEvent(sid, subscription, message)

    def _ackEvent(self, sid, subscription, message):
        self.events.emit(
            "ack",
            mid=message.mid,
            topic=message.topic,
            session=sid,
            latency=round(subscription.outbox.clock.seconds() - message.published, 6),
        )

    def ackedTogether(self, sid, acked):
        """
        Deliveries were acked together: C{acked} holds each as C{(delivery
        id, delivery)} (L{Outbox._inflight}).
        """
        self.counters.settled("acked", len(acked))
        if self.events.messageEvents:
            for _, (subscription, message, _, _, _, _) in acked:
                self._ackEvent(sid, subscription, message)

    def replaced(self, sid, message, newer):
        self.counters.settled("replaced")
        events = self.events
        if events.messageEvents:
            events.emit("replace", mid=message.mid, topic=message.topic, session=sid, by=newer.mid)

    def slowConsumer(self, outbox, idle, queued):
        """
        A subscriber made no progress for C{idle} seconds while its full
        queue (C{queued} messages) held publishers back.
        """
        self.counters.count("slow_consumers")
        subscriber = outbox.subscriber
        self.events.emit(
            "slow_consumer",
            LogLevel.warn,
            session=outbox.sid,
            client=subscriber.peer,
            transport=subscriber.transportName,
            idle=round(idle, 3),
            queued=queued,
            policy=outbox.config.slowConsumer,
        )

    def queueFull(self, outbox, limit, maximum):
        """
        A message met a session's full queue: C{limit} is the bound it hit.
        """
        subscriber = outbox.subscriber
        self.limits.refused(limit, maximum, subscriber.peer, subscriber.transportName, outbox.sid)

    def dropped(self, sid, subscription, message, reason):
        self.counters.dropped(reason, subscription.bridge)
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
