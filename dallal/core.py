"""
The broker core: who is subscribed to what, and who gets each message.

It is transport-independent: clients reach it as L{ISubscriber} providers
(a TCP connection, a UDP address), it hands them L{Message}s, and it knows
nothing of sockets, frames or ports.  Time comes from an injected
C{IReactorTime}, so tests drive it with C{task.Clock}.
"""

from collections import Counter
from dataclasses import dataclass

from twisted.logger import LogLevel

from dallal.delivery import LATEST, MODES, DeliveryConfig, Ledger, Outbox, Subscription
from dallal.errors import BAD_ARGUMENTS, BAD_TOPIC, PAYLOAD_TOO_LARGE, RequestError
from dallal.events import EventLog
from dallal.topics import MAX_TOPIC_LENGTH, TopicError, checkTopic

DEFAULT_MAX_PAYLOAD = 1024 * 1024


@dataclass(frozen=True)
class BrokerConfig:
    """
    The limits and switches of one broker.
    """

    maxPayload: int = DEFAULT_MAX_PAYLOAD
    maxTopicLength: int = MAX_TOPIC_LENGTH
    maxControlLine: int = 4096
    messageEvents: bool = True
    delivery: DeliveryConfig = DeliveryConfig()


class Message:
    """
    One published message, shared by every delivery of it.

    @ivar mid: the broker's id for it, unique for the broker's lifetime.
    @ivar wireTopic: the topic encoded as UTF-8, computed once for every
        frame that carries it.
    """

    __slots__ = ("mid", "topic", "wireTopic", "payload", "publisher", "published")

    def __init__(self, mid, topic, payload, publisher, published):
        self.mid = mid
        self.topic = topic
        self.wireTopic = topic.encode("utf-8")
        self.payload = payload
        self.publisher = publisher
        self.published = published


class _Session:
    """
    What the broker knows about one attached client.

    @ivar subscriptions: topic -> L{Subscription}.
    """

    __slots__ = ("sid", "subscriber", "subscriptions", "outbox")

    def __init__(self, sid, subscriber, outbox):
        self.sid = sid
        self.subscriber = subscriber
        self.subscriptions = {}
        self.outbox = outbox


class Broker:
    """
    Routes published messages to the subscribers of their topic.

    @ivar counters: running totals (see docs/EVENTS.md for their meaning).
    """

    def __init__(self, clock, config=BrokerConfig(), events=None):
        self.clock = clock
        self.config = config
        self.events = events if events is not None else EventLog(
            clock, messageEvents=config.messageEvents
        )
        self._sessions = {}
        self._subscribers = {}
        self._nextSid = 1
        self._nextMid = 1
        self.started = clock.seconds()
        self.counters = Counter(
            connections=0,
            connections_total=0,
            subscriptions=0,
            published=0,
            bytes_in=0,
            bytes_out=0,
            errors=0,
            pings_missed=0,
            clients_dropped=0,
            duplicates=0,
            unsent=0,
        )
        self.ledger = Ledger(self.counters, self.events)

    # Sessions

    def attach(self, subscriber, delivery=None):
        """
        A client has arrived.  Nothing is sent to it before it subscribes.

        @param delivery: the L{DeliveryConfig} of the client's transport, if
            not the broker's (UDP resends sooner, and carries less).
        """
        sid = self._nextSid
        self._nextSid += 1
        if delivery is None:
            delivery = self.config.delivery
        outbox = Outbox(subscriber, sid, delivery, self.clock, self.ledger)
        session = _Session(sid, subscriber, outbox)
        self._sessions[subscriber] = session
        self.counters["connections"] += 1
        self.counters["connections_total"] += 1
        self.events.emit(
            "connect",
            session=session.sid,
            client=subscriber.peer,
            transport=subscriber.transportName,
        )

    def detach(self, subscriber, reason):
        """
        A client has gone; its subscriptions and everything queued for it go
        with it.

        @param reason: a one-word reason for the log (C{closed},
            C{missed_pings}, C{protocol_error}, ...).
        """
        session = self._sessions.pop(subscriber, None)
        if session is None:
            return
        for topic in session.subscriptions:
            subscribers = self._subscribers[topic]
            del subscribers[subscriber]
            if not subscribers:
                del self._subscribers[topic]
        session.outbox.close(session.subscriptions.values())
        self.counters["subscriptions"] -= len(session.subscriptions)
        self.counters["connections"] -= 1
        self.events.emit(
            "disconnect",
            session=session.sid,
            client=subscriber.peer,
            transport=subscriber.transportName,
            reason=reason,
            subscriptions=len(session.subscriptions),
        )

    def sessionId(self, subscriber):
        return self._sessions[subscriber].sid

    def acknowledge(self, subscriber, deliveryId):
        """
        The client acked a delivery; late and unknown acks are ignored.
        """
        self._sessions[subscriber].outbox.acknowledge(deliveryId)

    def pauseDelivery(self, subscriber):
        """
        The client's transport is full: hold its messages in the broker.
        """
        self._sessions[subscriber].outbox.pause()

    def resumeDelivery(self, subscriber):
        self._sessions[subscriber].outbox.resume()

    def shutdown(self):
        """
        Close every session, accounting for what they still held, and log
        the final counters.
        """
        for session in list(self._sessions.values()):
            self.detach(session.subscriber, "shutdown")
            session.subscriber.disconnect("shutdown")
        self.logStats()

    def stats(self):
        """
        The counters of docs/EVENTS.md, and the broker's uptime in seconds.
        """
        stats = dict(self.counters)
        stats["uptime"] = round(self.clock.seconds() - self.started, 3)
        return stats

    def logStats(self):
        self.events.emit("stats", **self.counters)

    # Requests

    def checkTopic(self, topic, requestId):
        try:
            checkTopic(topic, self.config.maxTopicLength)
        except TopicError as e:
            raise RequestError(BAD_TOPIC, str(e), requestId)

    def checkPayloadSize(self, size, requestId):
        """
        Refuse a payload larger than the broker accepts, before it is read.
        """
        if size > self.config.maxPayload:
            raise RequestError(
                PAYLOAD_TOO_LARGE,
                f"payload of {size} bytes is larger than the maximum of "
                f"{self.config.maxPayload}",
                requestId,
            )

    def subscribe(self, subscriber, topic, requestId, mode=LATEST):
        """
        Subscribe a client to a topic.  Subscribing again to the same topic
        changes the subscription's id and mode; the client still gets one
        copy of each message.

        @param mode: C{latest}, C{all} or C{fire} (see L{dallal.delivery}).
        @raise RequestError: the topic or the mode is refused.
        """
        self.checkTopic(topic, requestId)
        if mode not in MODES:
            raise RequestError(
                BAD_ARGUMENTS, f"mode must be one of {', '.join(MODES)}, not {mode!r}", requestId
            )
        session = self._sessions[subscriber]
        subscription = session.subscriptions.get(topic)
        if subscription is None:
            subscription = Subscription(requestId, topic, mode, session.outbox)
            session.subscriptions[topic] = subscription
            self._subscribers.setdefault(topic, {})[subscriber] = subscription
            self.counters["subscriptions"] += 1
        else:
            subscription.id = requestId
            subscription.mode = mode
        self.events.emit(
            "subscribe",
            session=session.sid,
            client=subscriber.peer,
            topic=topic,
            mode=mode,
        )

    def publish(self, subscriber, topic, payload, requestId):
        """
        Publish a message and hand it to every subscriber of its topic.

        @return: the L{Message}.
        @raise RequestError: the topic or the payload is refused.
        """
        self.checkTopic(topic, requestId)
        self.checkPayloadSize(len(payload), requestId)
        message = Message(
            self._nextMid, topic, payload, subscriber.peer, self.clock.seconds()
        )
        self._nextMid += 1
        counters = self.counters
        counters["published"] += 1
        counters["bytes_in"] += len(payload)
        receivers = self._subscribers.get(topic)
        events = self.events
        if events.messageEvents:
            events.emit(
                "publish",
                mid=message.mid,
                topic=topic,
                bytes=len(payload),
                session=self._sessions[subscriber].sid,
                client=subscriber.peer,
                transport=subscriber.transportName,
                subscribers=len(receivers) if receivers else 0,
            )
        if receivers:
            # A delivery may disconnect a slow consumer, changing the dict.
            for subscription in list(receivers.values()):
                subscription.outbox.offer(subscription, message)
        return message

    # Health

    def pingMissed(self, subscriber, missed):
        self.counters["pings_missed"] += 1
        self.events.emit(
            "ping_missed",
            LogLevel.warn,
            session=self.sessionId(subscriber),
            client=subscriber.peer,
            missed=missed,
        )

    def clientDropped(self, subscriber, missed):
        """
        Record that a client is being dropped for not answering pings.
        """
        self.counters["clients_dropped"] += 1
        self.events.emit(
            "client_dropped",
            LogLevel.warn,
            session=self.sessionId(subscriber),
            client=subscriber.peer,
            missed=missed,
        )

    def protocolError(self, subscriber, code, fatal):
        """
        Record that a client sent something the broker refused.
        """
        self.counters["errors"] += 1
        session = self._sessions.get(subscriber)
        self.events.emit(
            "protocol_error",
            LogLevel.warn,
            session=session.sid if session else 0,
            client=subscriber.peer,
            code=code,
            fatal=fatal,
        )
