"""
How a client that lost its connection comes back: a bridge
(L{dallal.server.bridge}) and C{dallal subscribe --reconnect} wait the
same growing delays.
"""

from twisted.application.internet import backoffPolicy

# Reconnecting (a bridge, `dallal subscribe --reconnect`): 1 s after losing
# an established connection, then twice as long after each failure, at most
# 15 s, plus up to 1 s of jitter so that the clients of a restarted broker do
# not all come back in the same instant.
RECONNECT_INITIAL_DELAY = 0.5
RECONNECT_FACTOR = 2.0
RECONNECT_MAX_DELAY = 15.0


def reconnectDelays():
    """
    @return: the seconds to wait before each attempt, given the number of
        attempts that failed in a row (L{backoffPolicy}, with jitter).
    """
    return backoffPolicy(RECONNECT_INITIAL_DELAY, RECONNECT_MAX_DELAY, RECONNECT_FACTOR)
