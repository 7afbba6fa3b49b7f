"""
The router: which subscriptions a message goes to, and handing it to them.

It holds every session's filters in a subscription tree, and the share
groups (L{dallal.broker.sharing}); it remembers each topic's route until
the subscriptions change, and asks the ACL which of the receivers may read
a message.  It is the one place a message is made and counted as published
(L{Router.publish}), whoever publishes it -- a client, a bridge, the broker
itself -- and it offers a new subscription the retained messages its
filter matches.
"""

from itertools import count

from dallal.broker.delivery import firesAtOnce, offerToEach
from dallal.broker.feed import RetainedFeed
from dallal.broker.message import Message
from dallal.broker.sharing import ShareGroup
from dallal.modes import ALL, FIRE, LATEST
from dallal.topictree import SubscriptionTree

# Bound of the memo of each topic's route: past it, it starts again empty.
TOPICS_REMEMBERED = 10_000

# Who publishes the broker's own topics, as the publish event names it.
OWN_PUBLISHER = "$SYS"
OWN_TRANSPORT = "sys"

# When two filters of one session match a message, it is delivered once,
# through the subscription whose mode promises the most: its rank in the
# subscription tree.
_MODE_STRENGTH = {FIRE: 0, LATEST: 1, ALL: 2}


def _remember(cache, key, value):
    """
    Keep C{value} under C{key} in C{cache}, which holds at most
    L{TOPICS_REMEMBERED} keys: a full cache starts again empty, so that a
    publisher of endless new topics costs a bounded memory.
    """
    if len(cache) >= TOPICS_REMEMBERED:
        cache.clear()
    cache[key] = value


class Router:
    """
    Routes the messages published to one broker to the subscriptions that
    match their topic.
    """

    def __init__(self, clock, events, counters, sessions, directory, topicTraffic, brokerName):
        """
        @param counters: the broker's L{dallal.broker.counters.Counters}.
        @param sessions: the broker's L{dallal.broker.sessions.SessionTable}.
        @param directory: the broker's
            L{dallal.broker.directory.TopicDirectory}, told of every filter
            subscribed to and given up.
        @param topicTraffic: the L{dallal.broker.sysstats.TopicTraffic}
            that counts what is published per topic.
        @param brokerName: the C{origin} of the messages published here.
        """
        self.clock = clock
        self.events = events
        self.counters = counters
        self.sessions = sessions
        self.directory = directory
        self.topicTraffic = topicTraffic
        self.brokerName = brokerName
        self._tree = SubscriptionTree(ranks=len(_MODE_STRENGTH))
        # (group name, filter) -> its ShareGroup.
        self._groups = {}
        # topic -> the subscriptions a message on it goes to, one per
        # subscriber (the strongest of its filters that match), before the
        # ACL's say; and the same by the topic's shape in the tree
        # (SubscriptionTree.shape), so a new topic of a known shape, as a
        # device's first message on devices/<id>/state, costs no walk.
        self._routes = {}
        self._routesByShape = {}
        # The ids of messages, published or offered as retained.
        self._mids = count(1)

    # Subscriptions

    def add(self, subscriber, key, subscription):
        """
        Route to a session's new subscription.

        @param key: its filter, or for a shared one C{(group name, filter)}.
        """
        if type(key) is tuple:
            self._joinGroup(key, subscription)
        else:
            self._rank(subscriber, subscription)
        self.directory.subscribed(subscription.topic)
        self._forgetRoutes()

    def changed(self, subscriber, key, subscription):
        """
        A session subscribed again with the same filter: its mode may have
        changed, which may change which of its filters carries a message.
        """
        if type(key) is not tuple:
            self._rank(subscriber, subscription)
        self._forgetRoutes()

    def _rank(self, subscriber, subscription):
        self._tree.add(
            subscription.topic, subscriber, subscription, _MODE_STRENGTH[subscription.mode]
        )

    def _joinGroup(self, key, subscription):
        """
        Add a shared subscription to its group, made (and routed to) when
        it gets its first member.

        @param key: C{(group name, filter)}.
        """
        group = self._groups.get(key)
        if group is None:
            group = self._groups[key] = ShareGroup(key[0], key[1], self._memberMayRead)
            self._tree.add(key[1], group, group)
        group.members.append(subscription)

    def _memberMayRead(self, subscription, topic):
        if not self.sessions.restricted:
            # No session's topics are restricted: no ACL to ask.
            return True
        return self.sessions.mayRead(subscription.outbox.subscriber, topic)

    def remove(self, subscriber, key):
        """
        Take a session's subscription (a filter, or for a shared one
        C{(group name, filter)}) out of the routes.
        """
        if type(key) is tuple:
            topicFilter = key[1]
            group = self._groups[key]
            group.members = [
                member for member in group.members if member.outbox.subscriber is not subscriber
            ]
            if not group.members:
                del self._groups[key]
                self._tree.remove(topicFilter, group)
        else:
            topicFilter = key
            self._tree.remove(topicFilter, subscriber)
        self._forgetRoutes()
        self.directory.unsubscribed(topicFilter)

    # Messages

    def publish(self, topic, payload, source, receivers=None, origin=None, properties=None):
        """
        Make a message, count it as published, and hand it to the
        subscriptions that want it, one per session.

        @param source: the L{dallal.broker.interfaces.ISubscriber} that
            published it, which a full queue holds back (never its own: a
            session that publishes to itself must not stop itself reading
            its acks); C{None} for the broker's own.
        @param receivers: the subscriptions it goes to, if not every one
            L{routeOf} its topic finds.
        @param origin: for a message that came over a bridge, its
            L{dallal.broker.origin.Origin}.
        @param properties: its transport's own attributes
            (L{Message.properties}).
        @return: the L{Message}.
        """
        message = Message(
            next(self._mids),
            topic,
            payload,
            OWN_PUBLISHER if source is None else source.peer,
            self.clock.seconds(),
            False,
            origin,
            properties,
            source,
        )
        self.counters.published(len(payload))
        if receivers is None:
            receivers = self.routeOf(topic)
        if self.sessions.restricted and receivers:
            receivers = self._readers(receivers, topic)
        self.topicTraffic.received(topic, len(payload))
        events = self.events
        if events.messageEvents:
            if source is None:
                sid, transportName = 0, OWN_TRANSPORT
            else:
                sid, transportName = self.sessions[source].sid, source.transportName
            events.emit(
                "publish",
                mid=message.mid,
                topic=topic,
                bytes=len(payload),
                session=sid,
                client=message.publisher,
                transport=transportName,
                subscribers=len(receivers),
                origin=self.brokerName if origin is None else origin.broker,
                hops=0 if origin is None else origin.hops,
            )
        offerToEach(receivers, message, source, self.sessions.ledger)
        return message

    def runReceivers(self, topic, source):
        """
        The subscriptions a run of messages from C{source} on C{topic}
        goes to, if L{publishRun} can take it: every one would be written
        each message at once, in C{fire} mode (L{firesAtOnce}), and no
        per-message event is logged.  (The broker has checked that no ACL
        restricts any session: L{dallal.broker.core.Broker.acceptsRun}.)

        @return: the subscriptions, or C{None}: the messages are published
            one by one.
        """
        if self.events.messageEvents:
            return None
        receivers = self.routeOf(topic)
        for subscription in receivers:
            if not firesAtOnce(subscription, source):
                return None
        return receivers

    def publishRun(self, topic, wireTopic, payloads, receivers):
        """
        Publish messages on one topic together, as many L{publish} would,
        to C{receivers} found by L{runReceivers} just before: each
        subscriber is written the whole run at once (C{sendMessageRun}),
        and the run is counted, as published and as fired, in one step.
        No L{Message} is made: nothing keeps one, or logs its id.

        @param wireTopic: C{topic} encoded as UTF-8.
        """
        messages = len(payloads)
        size = sum(map(len, payloads))
        self.counters.published(size, messages)
        self.topicTraffic.received(topic, size, messages)
        if not receivers:
            return
        for subscription in receivers:
            firstSeq = subscription.lastSeq + 1
            subscription.lastSeq += messages
            subscription.outbox.subscriber.sendMessageRun(
                topic, wireTopic, payloads, subscription.id, firstSeq
            )
        self.sessions.ledger.firedTogether(
            topic,
            messages * len(receivers),
            size * len(receivers),
            messages * sum(subscription.bridge for subscription in receivers),
            offered=True,
        )

    def routeOf(self, topic):
        """
        The subscriptions a message on C{topic} goes to, one per session:
        found in the tree, then remembered, by topic and by shape, until
        the subscriptions change.
        """
        receivers = self._routes.get(topic)
        if receivers is None:
            shape = self._tree.shape(topic)
            receivers = self._routesByShape.get(shape)
            if receivers is None:
                receivers = list(self._tree.best(topic).values())
                _remember(self._routesByShape, shape, receivers)
            _remember(self._routes, topic, receivers)
        return receivers

    def _forgetRoutes(self):
        """
        The subscriptions changed: every remembered route may be wrong.
        """
        self._routes.clear()
        self._routesByShape.clear()

    def _readers(self, receivers, topic):
        """
        The receiving subscriptions of a message on C{topic} whose session
        may read it (a share group, which has no session, asks its
        members' sessions itself).
        """
        mayRead = self.sessions.mayRead
        return [
            subscription
            for subscription in receivers
            if mayRead(subscription.outbox.subscriber, topic)
        ]

    # Retained messages

    def offerRetained(self, session, subscription, found):
        """
        Offer a new subscription retained messages, marked as retained:
        those of C{found} the client may read when each is offered.  The
        first slice is offered now, the rest on later turns of the reactor
        as the subscriber takes them (L{dallal.broker.feed}).

        @param found: the C{(topic, payload)} pairs its filter matches.
        """
        if subscription.retainedFeed is not None:
            subscription.retainedFeed.stop()

        def offer(topic, payload):
            self._offerRetained(session, subscription, topic, payload)

        RetainedFeed(self.clock, subscription, found, offer).start()

    def _offerRetained(self, session, subscription, topic, payload):
        permissions = session.permissions
        if permissions is not None and not permissions.mayRead(topic):
            return
        message = Message(next(self._mids), topic, payload, "retained", self.clock.seconds(), True)
        if self.events.messageEvents:
            self.events.emit(
                "retained",
                mid=message.mid,
                topic=topic,
                bytes=len(payload),
                session=session.sid,
                client=session.subscriber.peer,
            )
        session.outbox.offer(subscription, message)
