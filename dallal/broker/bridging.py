"""
Bridging: this broker's part in a mesh of bridged brokers (PROTOCOL.md,
"Bridges") -- its name and incarnation, the origin every message carries
over a bridge, the messages it has seen (so that a loop or a second path
delivers each once), and who may send bridge frames.
"""

import secrets

from dallal.broker.origin import MAX_HOPS, Origin, SeenMessages
from dallal.errors import NOT_AUTHORIZED, RequestError

# Why a bridged message is discarded on arrival -> what counts it: its own
# message coming back, or a copy, is a duplicate.
_DISCARD_COUNTERS = {
    "loop": "bridged_duplicates",
    "duplicate": "bridged_duplicates",
    "hop_limit": "bridged_hop_limit",
}


class Bridging:
    """
    What one broker knows of the mesh it is bridged into.

    @ivar name: the broker's name among bridged brokers, the C{origin} of
        the messages published here.
    @ivar incarnation: tells this run's message ids from those of its
        earlier runs, which restarted at 1, for the brokers that remember
        the messages they saw.
    @ivar seen: the L{SeenMessages} that came over bridges.
    @ivar bridges: this broker's bridges to others by name, each with a
        C{status()} for C{STATS} (L{dallal.server.bridge.BridgeLink}).
    """

    def __init__(self, clock, events, counters, sessions, router, name):
        """
        @param counters: the broker's L{dallal.broker.counters.Counters}.
        @param sessions: the broker's L{dallal.broker.sessions.SessionTable}.
        @param router: the broker's L{dallal.broker.router.Router}.
        """
        self.events = events
        self.counters = counters
        self.sessions = sessions
        self.router = router
        self.name = name
        self.incarnation = secrets.token_hex(4)
        self.seen = SeenMessages(clock)
        self.bridges = {}

    def checkBridging(self, subscriber, topic, requestId):
        """
        Refuse a bridge frame (a C{PUB} with C{origin=}, a C{SUB} with
        C{bridge=1}) from a client that is no bridge: it could otherwise
        claim the origin of other brokers' messages (PROTOCOL.md, "Who may
        bridge").

        @raise RequestError: C{NOT_AUTHORIZED}, counted and logged as
            C{denied}.
        """
        session = self.sessions[subscriber]
        if not session.mayBridge:
            self.sessions.denied(session, "bridge", topic)
            raise RequestError(
                NOT_AUTHORIZED,
                f"user {session.user} is not a bridge: only the broker's --bridge-users "
                "may send origin= or bridge=1",
                requestId,
            )

    def received(self, subscriber, topic, payload, sent):
        """
        Publish a message that came over a bridge, its topic and payload
        checked, unless this broker has routed it already: it is never sent
        back on the session it came on, its copies that come by other paths
        are discarded, and so is a message that crossed too many bridges.

        @param sent: the L{Origin} the message was sent with.
        @return: the L{dallal.broker.message.Message}, or C{None} if it was
            discarded (counted, and logged with the per-message events).
        """
        origin = Origin(sent.broker, sent.messageId, sent.hops + 1)
        if origin.broker == self.name:
            discarded = "loop"
        elif origin.hops > MAX_HOPS:
            discarded = "hop_limit"
        elif not self.seen.firstTime(origin, topic, payload):
            discarded = "duplicate"
        else:
            discarded = None
        if discarded is not None:
            self.counters.count(_DISCARD_COUNTERS[discarded])
            if self.events.messageEvents:
                self.events.emit(
                    "bridge_discard",
                    topic=topic,
                    session=self.sessions[subscriber].sid,
                    origin=origin.broker,
                    hops=origin.hops,
                    reason=discarded,
                )
            return None
        self.counters.count("bridged_published")
        # Never back on the session it came on.
        receivers = [
            subscription
            for subscription in self.router.routeOf(topic)
            if subscription.outbox.subscriber is not subscriber
        ]
        return self.router.publish(topic, payload, subscriber, receivers, origin)

    def originOf(self, message):
        """
        The L{Origin} a message carries over a bridge.
        """
        if message.origin is None:
            return Origin(self.name, f"{self.incarnation}.{message.mid}", 0)
        return message.origin
