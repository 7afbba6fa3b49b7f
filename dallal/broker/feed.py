"""
A new subscription's retained messages, sent a slice at a time.

A filter such as C{#} may match every retained message the broker keeps
(up to C{--max-retained}, 100,000 by default).  Offering them all in the
request that subscribed would keep the broker from serving anybody else for
as long, and would put them all in the subscriber's queue at once.  A
L{RetainedFeed} offers them instead L{RETAINED_PER_TURN} at a time, one slice
per turn of the reactor, and only while the subscriber's outbox has room
(L{dallal.broker.delivery.Outbox.hasRoom}): a subscriber that does not read
stops the feed, which goes on when its outbox drains.

Order (PROTOCOL.md, "Retained messages"): on each topic the retained message
comes before any message published there after the subscription; a message
published on a topic whose retained message is still waiting has that
retained message offered first, out of its turn.  Retained messages on other
topics may arrive after it: the feed orders each topic, as subscribers see
topics, not the whole filter.
"""

# Retained messages offered to one subscription per turn of the reactor.
RETAINED_PER_TURN = 256


class RetainedFeed:
    """
    The retained messages waiting for one subscription.

    @param found: the C{(topic, payload)} pairs its filter matched, in the
        order to send them.
    @param offer: called as C{offer(topic, payload)} to offer one to the
        subscription (the broker makes it a retained message).
    """

    def __init__(self, clock, subscription, found, offer, perTurn=RETAINED_PER_TURN):
        self._clock = clock
        self._subscription = subscription
        self._outbox = subscription.outbox
        self._offer = offer
        self._perTurn = perTurn
        # The topics in their order, and those still waiting -> their
        # payload: a topic sent out of its turn leaves the second only.
        self._topics = [topic for topic, _ in found]
        self._waiting = dict(found)
        self._next = 0
        self._nextSlice = None

    def start(self):
        """
        Offer the first slice now, and the others on later turns.
        """
        self._subscription.retainedFeed = self
        self._sendSlice()

    def stop(self):
        """
        Offer nothing more: the subscription ended, or a new feed replaces
        this one.
        """
        self._waiting.clear()
        if self._nextSlice is not None and self._nextSlice.active():
            self._nextSlice.cancel()
        self._nextSlice = None
        if self._subscription.retainedFeed is self:
            self._subscription.retainedFeed = None

    def before(self, topic):
        """
        A message on C{topic} is about to be offered to the subscription:
        the topic's retained message goes first, if it still waits.
        """
        payload = self._waiting.pop(topic, None)
        if payload is not None:
            self._offer(topic, payload)

    def _sendSlice(self):
        self._nextSlice = None
        outbox = self._outbox
        waiting = self._waiting
        topics = self._topics
        offered = 0
        while waiting:
            if outbox.closed:
                self.stop()
                return
            if not outbox.hasRoom():
                outbox.whenRoom(self._sendSlice)
                return
            if offered == self._perTurn:
                self._nextSlice = self._clock.callLater(0, self._sendSlice)
                return
            topic = topics[self._next]
            self._next += 1
            payload = waiting.pop(topic, None)
            if payload is not None:
                self._offer(topic, payload)
                offered += 1
        self.stop()
