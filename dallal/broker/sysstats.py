"""
The broker's statistics on its own topics, C{$SYS/broker/...}, as Mosquitto
publishes them for operators, and its traffic per topic, logged for the log
analytics (L{TopicTraffic}).

Every interval the L{SysPublisher} reads the broker's counters and publishes
the values that changed since its last round.  The broker keeps each topic's
last value as its retained message, in memory only: a new subscriber to
C{$SYS/#} gets every current value at once, and a restart starts them afresh
anyway (the counters restart from zero), so writing them to the retained
store's disk every interval would cost writes for nothing.

Filters starting with a wildcard (C{#}, C{+/...}) do not match C{$} topics
(L{dallal.topictree}): only a subscriber that names C{$SYS} sees them.
"""

import math

from twisted.internet.task import LoopingCall
from twisted.logger import Logger

from dallal import __version__

PREFIX = "$SYS/broker/"
DEFAULT_INTERVAL = 10.0

# Topic (after PREFIX) -> the counter it shows (docs/EVENTS.md).
COUNTER_TOPICS = {
    "clients/connected": "connections",
    "clients/total": "connections_total",
    "subscriptions/count": "subscriptions",
    "messages/inflight": "inflight",
    "messages/dropped": "dropped",
    "messages/replaced": "replaced",
    "bytes/received": "bytes_in",
    "bytes/sent": "bytes_out",
    "messages/bridged/received": "bridged_published",
    "messages/bridged/sent": "bridged_delivered",
    "messages/bridged/dropped": "bridged_dropped",
    "messages/bridged/duplicates": "bridged_duplicates",
}

# Topic under bridges/<name>/ -> the field of the bridge's status it shows.
BRIDGE_TOPICS = {
    "state": "state",
    "connects": "connects",
    "messages/received": "received",
    "messages/sent": "forwarded",
}

# The moving averages of C{load/<quantity>/<window>}: seconds each window
# spans, as Mosquitto's 1, 5 and 15 minutes.
LOAD_WINDOWS = {"1min": 60.0, "5min": 300.0, "15min": 900.0}


def _received(stats):
    """
    Messages published by clients and bridges: the broker's own C{$SYS}
    messages left out.
    """
    return stats["published"] - stats["sys_published"]


def _sent(stats):
    """
    Messages sent to subscribers, redeliveries included.
    """
    return stats["delivered"] + stats["redelivered"]


# Quantity -> how to read its running total from the broker's stats.
LOAD_QUANTITIES = {
    "messages/received": _received,
    "messages/sent": _sent,
    "bytes/received": lambda stats: stats["bytes_in"],
    "bytes/sent": lambda stats: stats["bytes_out"],
}


def sysValues(stats):
    """
    The instantaneous C{$SYS} values of a broker's stats, without the
    loads: topic (after L{PREFIX}) -> text.
    """
    values = {topic: str(stats[counter]) for topic, counter in COUNTER_TOPICS.items()}
    values["version"] = f"dallal {__version__}"
    values["uptime"] = str(int(stats["uptime"]))
    values["messages/received"] = str(_received(stats))
    values["messages/sent"] = str(_sent(stats))
    for name, status in stats.get("bridges", {}).items():
        for topic, field in BRIDGE_TOPICS.items():
            values[f"bridges/{name}/{topic}"] = str(status[field])
    return values


# The topics a topic_traffic summary names, the busiest first; the others'
# traffic is summed in one topic_traffic_other event.
TOPICS_SUMMARIZED = 20
# The topics counted apart in one interval: the traffic of more is counted
# with the others', so the counts take bounded memory whatever clients do.
TOPICS_COUNTED = 1000


# The most topics whose published messages are counted since the start.
TOPICS_PUBLISHED = 10_000


class TopicTraffic:
    """
    Messages and bytes in and out per topic since the last summary: what
    the log analytics need of a broker's traffic when it does not log an
    event per message (docs/EVENTS.md, C{topic_traffic}).

    Each count is a list C{[messages in, bytes in, messages out, bytes out]}
    updated in place: one dictionary lookup per message published or sent.
    """

    def __init__(self, clock):
        self.clock = clock
        self.since = clock.seconds()
        # topic -> messages published on it since the start, for the
        # dashboard's busiest topics; it starts again empty past
        # TOPICS_PUBLISHED topics.
        self.published = {}
        self.topics = {}
        # The traffic of topics past TOPICS_COUNTED in this interval.
        self.overflow = [0, 0, 0, 0]

    def _counts(self, topic):
        counts = self.topics.get(topic)
        if counts is None:
            if len(self.topics) >= TOPICS_COUNTED:
                return self.overflow
            counts = self.topics[topic] = [0, 0, 0, 0]
        return counts

    def received(self, topic, size, messages=1):
        """
        A message of C{size} bytes was published on C{topic}; or
        C{messages} of them, C{size} bytes in all.
        """
        # Once per message: a topic already counted costs no call.
        counts = self.topics.get(topic) or self._counts(topic)
        counts[0] += messages
        counts[1] += size
        published = self.published
        count = published.get(topic)
        if count is None:
            if len(published) >= TOPICS_PUBLISHED:
                published.clear()
            count = 0
        published[topic] = count + messages

    def sent(self, topic, size, first):
        """
        Deliveries of C{size} bytes in all on C{topic} were sent, C{first}
        of them (a count, or a bool for one) for the first time: the
        others are redeliveries, whose bytes count but which are no new
        messages out, as in the broker's C{delivered} and C{bytes_out}
        counters.
        """
        counts = self.topics.get(topic) or self._counts(topic)
        counts[2] += first
        counts[3] += size

    def log(self, events):
        """
        Log the traffic since the last summary and start counting afresh:
        a C{topic_traffic} event for each of the L{TOPICS_SUMMARIZED}
        busiest topics, one C{topic_traffic_other} for the rest; nothing
        for an interval without traffic.
        """
        now = self.clock.seconds()
        seconds = round(now - self.since, 3)
        ranked = sorted(self.topics.items(), key=lambda item: (-(item[1][0] + item[1][2]), item[0]))
        for topic, (messagesIn, bytesIn, messagesOut, bytesOut) in ranked[:TOPICS_SUMMARIZED]:
            events.emit(
                "topic_traffic",
                topic=topic,
                messages_in=messagesIn,
                bytes_in=bytesIn,
                messages_out=messagesOut,
                bytes_out=bytesOut,
                seconds=seconds,
            )
        rest = ranked[TOPICS_SUMMARIZED:]
        other = [sum(column) for column in zip(self.overflow, *(counts for _, counts in rest))]
        if any(other):
            events.emit(
                "topic_traffic_other",
                topics=len(rest),
                messages_in=other[0],
                bytes_in=other[1],
                messages_out=other[2],
                bytes_out=other[3],
                seconds=seconds,
            )
        self.topics = {}
        self.overflow = [0, 0, 0, 0]
        self.since = now


class _Load:
    """
    Per-second rates of one running total, as exponentially weighted moving
    averages over each of L{LOAD_WINDOWS} (what Unix load averages and
    Mosquitto's C{load/...} topics are).
    """

    def __init__(self):
        self.averages = dict.fromkeys(LOAD_WINDOWS, 0.0)

    def update(self, increase, elapsed):
        rate = increase / elapsed
        for window, span in LOAD_WINDOWS.items():
            # A longer gap between rounds weighs the new rate more.
            weight = 1.0 - math.exp(-elapsed / span)
            self.averages[window] += weight * (rate - self.averages[window])


class SysPublisher:
    """
    Publishes a broker's statistics on C{$SYS/broker/...} every C{interval}
    seconds of C{clock}.
    """

    _log = Logger()

    def __init__(self, broker, clock, interval=DEFAULT_INTERVAL):
        self.broker = broker
        self.clock = clock
        self.interval = interval
        self._loop = None
        # Topic -> the value last published on it.
        self._published = {}
        self._loads = {quantity: _Load() for quantity in LOAD_QUANTITIES}
        self._lastTotals = None
        self._lastTime = None

    def start(self):
        """
        Publish now, then every interval.
        """
        loop = self._loop = LoopingCall(self.publish)
        loop.clock = self.clock
        # A LoopingCall whose function raises stops for good: say so loudly.
        loop.start(self.interval, now=True).addErrback(
            lambda failure: self._log.failure("$SYS statistics stopped", failure)
        )

    def stop(self):
        if self._loop is not None and self._loop.running:
            self._loop.stop()
        self._loop = None

    def _values(self):
        """
        Every C{$SYS} topic and its value now, loads included (updated with
        what happened since the last round): full topic -> text.
        """
        stats = self.broker.stats()
        self._updateLoads(stats)
        values = sysValues(stats)
        for quantity, load in self._loads.items():
            for window, average in load.averages.items():
                values[f"load/{quantity}/{window}"] = f"{average:.2f}"
        return {PREFIX + topic: value for topic, value in values.items()}

    def _updateLoads(self, stats):
        now = self.clock.seconds()
        totals = {quantity: read(stats) for quantity, read in LOAD_QUANTITIES.items()}
        if self._lastTime is not None:
            elapsed = now - self._lastTime
            if elapsed <= 0:
                return
            for quantity, total in totals.items():
                self._loads[quantity].update(total - self._lastTotals[quantity], elapsed)
        self._lastTotals = totals
        self._lastTime = now

    def publish(self):
        """
        One round: log the traffic per topic since the last round, and
        publish the values that changed since the last.
        """
        self.broker.topicTraffic.log(self.broker.events)
        for topic, value in self._values().items():
            if self._published.get(topic) != value:
                self._published[topic] = value
                self.broker.publishOwn(topic, value.encode("utf-8"))
