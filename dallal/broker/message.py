"""
One published message, as the broker's parts pass it around: made by the
router (L{dallal.broker.router.Router.publish}), queued by the outboxes,
written by the transports.
"""


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
    @ivar source: the L{ISubscriber} that published it, or C{None} (the
        broker's own, a retained message), for the subscriptions that do
        not want their own messages back.
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
        self.source = source
