"""
The requests a client sent and the broker has not answered yet.
"""

from twisted.internet.defer import Deferred


class PendingRequests:
    """
    Each unanswered request's Deferred, by request id: the answer that
    matches an id fires it, and losing the connection fails them all.
    """

    def __init__(self):
        self._deferreds = {}

    def __contains__(self, requestId):
        return requestId in self._deferreds

    def add(self, requestId, cancelled):
        """
        Wait for the answer to a request sent.

        @param cancelled: called with C{requestId} if the caller cancels
            the Deferred (a timeout, for instance): the client stops
            waiting for, and resending, the request.
        @return: the Deferred the answer fires.
        """
        deferred = Deferred(lambda d: cancelled(requestId))
        self._deferreds[requestId] = deferred
        return deferred

    def take(self, requestId):
        """
        The Deferred waiting for the answer to a request, which stops
        waiting; C{None} if none is.
        """
        return self._deferreds.pop(requestId, None)

    def failAll(self, reason):
        """
        Fail every request waiting with C{reason}: no answer will come.
        """
        deferreds, self._deferreds = self._deferreds, {}
        for deferred in deferreds.values():
            deferred.errback(reason)
