"""
What a client's Deferreds fail with, besides Twisted's own connection errors.
"""

from twisted.internet.error import ConnectionDone, ConnectionLost


class ServerError(Exception):
    """
    The broker refused a request.
    """

    def __init__(self, code, reason):
        Exception.__init__(self, code, reason)
        self.code = code
        self.reason = reason

    def __str__(self):
        return f"{self.code}: {self.reason}"


class ClientProtocolError(Exception):
    """
    The broker sent something this client cannot understand.
    """


class SessionLost(ConnectionLost):
    """
    The broker no longer knows this UDP client: its session expired, or the
    broker restarted.  Its subscriptions are gone.
    """

    def __str__(self):
        return " ".join(map(str, self.args))


class ClosedUnanswered(ConnectionDone):
    """
    The broker closed the connection before it sent a single frame: what a
    TLS listener does to a client that speaks plain TCP to it.
    """
