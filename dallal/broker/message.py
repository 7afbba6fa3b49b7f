"""
One published message, as the broker's parts pass it around: made by the
router (L{dallal.broker.router.Router.publish}), queued by the outboxes,
written by the transports.
"""

from weakref import ref


class Message:
    """
    One published message, shared by every delivery of it.

    @ivar mid: the broker's id for it, unique for the broker's lifetime.
    @ivar wireTopic: the topic encoded as UTF-8, computed once for every
        frame that carries it.
    @ivar retained: whether it comes from the retained store, sent to a new
        subscription, rather than from a publish as it happened.
    @ivar encoding: what a transport encoded once for all its deliveries
        of it (the Dallal codec: what all its C{MSG} frames share), or
        C{None}.  It is opaque to the broker: the transport that fills it
        knows its own value from another's, and one that finds another's
        encodes for itself.  (One slot rather than a dict per transport: a
        dict more per message costs several per cent of the broker's CPU in
        C{bench/firehose.py --mode all}.)
    @ivar origin: for a message that came over a bridge, the
        L{dallal.broker.origin.Origin} it came with, its C{hops} counting
        that bridge; C{None} for a message published here.
    @ivar properties: what the publisher's transport attached to it, opaque
        to the core and passed through to every subscriber's transport (an
        MQTT message's QoS, retain flag and properties), or C{None}.
    @ivar source: a weak reference to the L{ISubscriber} that published
        it, or C{None} (the broker's own, a retained message), for the
        subscriptions that do not want their own messages back (see
        L{publishedBy}).  Weak, as a message waits in queues long after its
        publisher is gone: the wills of a client id taken over and back in
        a loop, queued for a session that does not ack, would each keep a
        whole closed session alive (its subscriptions, its caches).
    """

    __slots__ = (
        "mid",
        "topic",
        "wireTopic",
        "payload",
        "publisher",
        "published",
        "retained",
        "encoding",
        "origin",
        "properties",
        "source",
    )

    def __init__(
        self,
        mid,
        topic,
        payload,
        publisher,
        published,
        retained=False,
        origin=None,
        properties=None,
        source=None,
    ):
        self.mid = mid
        self.topic = topic
        self.wireTopic = topic.encode("utf-8")
        self.payload = payload
        self.publisher = publisher
        self.published = published
        self.retained = retained
        self.encoding = None
        self.origin = origin
        self.properties = properties
        # ref() of an object gives the same weak reference while one
        # lives: no allocation per message of a publisher.
        self.source = None if source is None else ref(source)

    def publishedBy(self, subscriber):
        """
        Whether C{subscriber} published this message (and still exists).
        """
        source = self.source
        return source is not None and source() is subscriber
