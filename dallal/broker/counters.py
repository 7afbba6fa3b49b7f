"""
The broker's counters (docs/EVENTS.md, "Counters"): the one object that
holds and changes them.

Every part of the broker, and every transport, reports what happened to
L{Counters} by a named method (C{published}, C{sent}, C{dropped}, ...), or
with L{Counters.count} for the counters that stand alone.  Everything else
only reads them: L{Counters} is a read-only mapping of counter name to
value, in the order C{STATS} and the C{stats} event list them.

The methods that move several counters at once keep the ledger's invariant
in one place: C{matched = acked + fired + replaced + dropped + inflight}.
"""

from collections.abc import Mapping

from dallal.limits import LIMITS

# Why a message is dropped, as counted (dropped_<reason>) and logged.
QUEUE_FULL = "queue_full"
SLOW_CONSUMER = "slow_consumer"
DISCONNECTED = "disconnected"
REDELIVERY_LIMIT = "redelivery_limit"
SUPERSEDED = "superseded"
TOO_LARGE = "too_large"
BRIDGE_REFUSED = "bridge_refused"
EXPIRED = "expired"
DROP_REASONS = (
    QUEUE_FULL,
    SLOW_CONSUMER,
    DISCONNECTED,
    REDELIVERY_LIMIT,
    SUPERSEDED,
    TOO_LARGE,
    BRIDGE_REFUSED,
    EXPIRED,
)

# The counters of connections, requests and health, in the order listed.
BROKER_COUNTERS = (
    "connections",
    "connections_total",
    "subscriptions",
    "published",
    "bytes_in",
    "bytes_out",
    "errors",
    "pings_missed",
    "clients_dropped",
    "duplicates",
    "unsent",
    "sys_published",
    "logins",
    "logins_failed",
    "logins_abandoned",
    "denied",
    "bridged_published",
    "bridged_duplicates",
    "bridged_hop_limit",
    "bridged_refused",
)

# The counters of deliveries.
DELIVERY_COUNTERS = (
    "matched",
    "delivered",
    "fired",
    "redelivered",
    "acked",
    "replaced",
    "dropped",
    "inflight",
    "bridged_delivered",
    "bridged_dropped",
    "slow_consumers",
    *("dropped_" + reason for reason in DROP_REASONS),
)

# The counters of flow control (L{dallal.broker.delivery.FlowControl}).
FLOW_COUNTERS = ("publishers_paused", "publishers_held", "publishes_busy")

COUNTERS = (
    *BROKER_COUNTERS,
    *(limit.counter for limit in LIMITS),
    *DELIVERY_COUNTERS,
    *FLOW_COUNTERS,
)


class Counters(Mapping):
    """
    The running totals of one broker, read as a mapping of counter name to
    value, changed only through its methods.
    """

    __slots__ = ("_values",)

    def __init__(self):
        # A plain dict: a Counter's item access costs twice as much on the
        # per-message path.
        self._values = dict.fromkeys(COUNTERS, 0)

    # Mapping

    def __getitem__(self, name):
        return self._values[name]

    def __iter__(self):
        return iter(self._values)

    def __len__(self):
        return len(self._values)

    def __repr__(self):
        return f"Counters({self._values!r})"

    # Changes

    def count(self, name, n=1):
        """
        Add C{n} to a counter that no other moves with (C{logins},
        C{errors}, C{duplicates}, ...).

        @raise KeyError: C{name} is no counter.
        """
        self._values[name] += n

    def connected(self):
        values = self._values
        values["connections"] += 1
        values["connections_total"] += 1

    def disconnected(self, subscriptions):
        """
        A session ended, and its C{subscriptions} with it.
        """
        values = self._values
        values["connections"] -= 1
        values["subscriptions"] -= subscriptions

    def published(self, size, messages=1):
        """
        A message of C{size} payload bytes was published, by a client, a
        bridge or the broker itself; or C{messages} of them, C{size} bytes
        in all.
        """
        values = self._values
        values["published"] += messages
        values["bytes_in"] += size

    def refused(self, limit):
        """
        One of the limits of L{dallal.limits} refused something.
        """
        self._values[limit.counter] += 1

    # Deliveries (L{dallal.broker.delivery.Ledger})

    def matched(self, deliveries=1):
        values = self._values
        values["matched"] += deliveries
        values["inflight"] += deliveries

    def sent(self, size, first, bridge):
        """
        A delivery of C{size} payload bytes was written: its first attempt
        (to a bridge, if C{bridge}), or a redelivery.
        """
        values = self._values
        values["bytes_out"] += size
        if first:
            values["delivered"] += 1
            if bridge:
                values["bridged_delivered"] += 1
        else:
            values["redelivered"] += 1

    def firedTogether(self, deliveries, size, bridged, offered):
        """
        C{deliveries} first deliveries in C{fire} mode, C{size} payload
        bytes in all, C{bridged} of them to bridges, were written and
        fired together, as many L{sent} and L{settled} would count them.

        @param offered: whether they were written as they were offered,
            and are counted as matched now (they never were in flight);
            else they were L{matched} and in flight while they waited.
        """
        values = self._values
        if offered:
            values["matched"] += deliveries
        else:
            values["inflight"] -= deliveries
        values["delivered"] += deliveries
        values["fired"] += deliveries
        values["bytes_out"] += size
        if bridged:
            values["bridged_delivered"] += bridged

    def sentTogether(self, deliveries, size, bridged, offered):
        """
        C{deliveries} first deliveries to be acked, C{size} payload bytes
        in all, C{bridged} of them to bridges, were written together, as
        many L{sent} would count them: they are in flight until acked or
        dropped.

        @param offered: whether they were written as they were offered,
            and are counted as matched and in flight now; else they were
            L{matched} while they waited.
        """
        values = self._values
        if offered:
            values["matched"] += deliveries
            values["inflight"] += deliveries
        values["delivered"] += deliveries
        values["bytes_out"] += size
        if bridged:
            values["bridged_delivered"] += bridged

    def settled(self, outcome, deliveries=1):
        """
        C{deliveries} left C{inflight} as C{acked}, C{fired} or C{replaced}.
        """
        values = self._values
        values[outcome] += deliveries
        values["inflight"] -= deliveries

    def dropped(self, reason, bridge):
        """
        A delivery left C{inflight} dropped for C{reason} (one of
        L{DROP_REASONS}).
        """
        values = self._values
        values["dropped"] += 1
        values["dropped_" + reason] += 1
        values["inflight"] -= 1
        if bridge:
            values["bridged_dropped"] += 1

    # Flow control

    def publisherHeld(self):
        values = self._values
        values["publishers_paused"] += 1
        values["publishers_held"] += 1

    def publisherReleased(self):
        self._values["publishers_held"] -= 1
