"""
Shared subscriptions: a group of subscriptions, of any sessions, to one
filter, among which each message goes to one member only (MQTT 5's
C{$share/<group>/<filter>}, NATS's queue groups).

The core routes a message to a L{ShareGroup} as to any subscription; the
group hands it on to one of its members, in turn, skipping the members
whose client is not reading (its outbox is paused) while another is, and
those the ACL does not let read the topic.
"""


class ShareGroup:
    """
    The members of one group sharing one filter.

    It stands in the broker's routes where a subscription would: C{outbox}
    is the group itself, whose L{offer} passes the message on to one
    member's outbox.

    @ivar members: the member L{dallal.broker.delivery.Subscription}s, in
        the order they joined.
    @ivar subscriber: C{None}: the group is no session.
    """

    __slots__ = ("name", "topic", "members", "_mayRead", "_next")
    # A group is sent no retained messages: none wait to go before a message.
    retainedFeed = None

    subscriber = None

    def __init__(self, name, topic, mayRead):
        """
        @param mayRead: C{mayRead(subscription, topic)}: whether the ACL lets
            the session of a member read a topic.
        """
        self.name = name
        self.topic = topic
        self.members = []
        self._mayRead = mayRead
        self._next = 0

    @property
    def outbox(self):
        return self

    def offer(self, group, message, publisher=None):
        """
        Hand C{message} to the next member that may read it, preferring
        one whose client is reading; drop it if none may.

        @param publisher: the publishing session, which a full queue holds
            back, as L{dallal.broker.delivery.Outbox.offer} says.
        """
        members = self.members
        count = len(members)
        chosen = None
        for step in range(count):
            member = members[(self._next + step) % count]
            if not self._mayRead(member, message.topic):
                continue
            if not member.outbox.paused:
                chosen = member
                self._next = (self._next + step + 1) % count
                break
            if chosen is None:
                chosen = member
        if chosen is not None:
            outbox = chosen.outbox
            outbox.offer(chosen, message, None if outbox.subscriber is publisher else publisher)
