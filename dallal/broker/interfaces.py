"""
The seam between the broker core and its transports.

The core (L{dallal.broker.core.Broker}) decides who gets what; a transport turns
its decisions into bytes.  A TCP connection, a UDP client, an MQTT connection
or session and a bridge each provide L{ISubscriber}; the core never sees a
socket.
"""

from zope.interface import Attribute, Interface


class ISubscriber(Interface):
    """
    A client session as the broker core sees it.
    """

    peer = Attribute("The client's address as 'host:port', for the log.")
    transportName = Attribute("'tcp' or 'udp', for the log and statistics.")

    def sendMessage(message, subscriptionId, seq, deliveryId, redelivered):
        """
        Send a L{dallal.broker.message.Message} to this client.

        Only called while the subscriber is attached to the broker.

        @param subscriptionId: the client's id of the subscription it matched.
        @param seq: that subscription's sequence number for it.
        @param deliveryId: the id the client acks it with, or C{None} when it
            needs no ack (C{fire} mode).
        @param redelivered: whether this is a resend.
        """

    def subscriptionRevoked(subscriptionId, reason):
        """
        The broker has ended one of this client's subscriptions (the ACL
        no longer lets it read what the filter matches): tell the client.

        @param subscriptionId: the client's id of the subscription.
        @param reason: why, for people.
        """

    def disconnect(reason):
        """
        Close the session; C{reason} is C{slow_consumer} (it fell too far
        behind, under the C{disconnect} policy) or C{shutdown} (the broker
        is stopping: flush what was written, then close).
        """

    def pausePublishing():
        """
        Take no more messages from this client for now: a subscriber it
        publishes to has a full queue (L{dallal.broker.delivery.FlowControl}).
        A TCP connection stops reading; a UDP session answers C{PUB}s with
        C{ERR <id> BUSY}.
        """

    def resumePublishing():
        """
        Take messages from this client again.
        """


class IRunSubscriber(ISubscriber):
    """
    A subscriber that may be written a run of live messages on one topic
    at once, to a C{fire} subscription, without a
    L{dallal.broker.message.Message} for each
    (L{dallal.broker.router.Router.publishRun}).
    """

    takesRuns = Attribute(
        "Whether it takes runs now: a subscriber whose messages each carry "
        "something of their own (a bridge's origin) does not."
    )

    def sendMessageRun(topic, wireTopic, payloads, subscriptionId, firstSeq):
        """
        Send messages on C{topic} (C{wireTopic} as UTF-8), live and not
        retained, as L{ISubscriber.sendMessage} would each in C{fire} mode.

        @param payloads: their payloads, in order.
        @param firstSeq: the subscription's sequence number for the first;
            the others follow it.
        """
