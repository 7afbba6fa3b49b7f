"""
How long a client waits before connecting again (L{dallal.client.reconnect}).
"""

from dallal.client.reconnect import (
    RECONNECT_FACTOR,
    RECONNECT_INITIAL_DELAY,
    RECONNECT_MAX_DELAY,
    reconnectDelays,
)


def test_delaysGrowToTheirMaximumWithAtMostASecondOfJitter():
    delays = reconnectDelays()
    for attempt in range(1, 12):
        base = min(RECONNECT_INITIAL_DELAY * RECONNECT_FACTOR**attempt, RECONNECT_MAX_DELAY)
        assert base <= delays(attempt) <= base + 1
