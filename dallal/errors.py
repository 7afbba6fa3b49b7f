"""
Why a request was refused: the error codes of the protocol.

Both the wire codec (malformed frames) and the broker core (requests it will
not carry out) raise L{RequestError}; a transport turns it into an C{ERR}
frame or datagram.  PROTOCOL.md lists the codes and which of them close the
connection.
"""

BAD_COMMAND = "BAD_COMMAND"
BAD_ARGUMENTS = "BAD_ARGUMENTS"
BAD_ID = "BAD_ID"
BAD_TOPIC = "BAD_TOPIC"
PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
LINE_TOO_LONG = "LINE_TOO_LONG"
BAD_FRAMING = "BAD_FRAMING"
# Over UDP only: the request's client=/token= do not match its source
# address (say HELLO again), or its client has no session (any more).
BAD_TOKEN = "BAD_TOKEN"
NO_SESSION = "NO_SESSION"

NOT_SUBSCRIBED = "NOT_SUBSCRIBED"
STORE_FAILED = "STORE_FAILED"
# Limits (dallal.limits): the broker serves as many clients, or this client
# has as many subscriptions, as it allows.
TOO_MANY_CLIENTS = "TOO_MANY_CLIENTS"
TOO_MANY_SUBSCRIPTIONS = "TOO_MANY_SUBSCRIPTIONS"
# A publish to every matching topic that would reach more than it allows.
TOO_MANY_TOPICS = "TOO_MANY_TOPICS"
# The broker is stopping: it finishes what is in flight, takes nothing new.
SHUTTING_DOWN = "SHUTTING_DOWN"
# Over UDP: a subscriber this client publishes to has a full queue; nothing
# was published, and the client resends later (a TCP connection is not
# read instead).
BUSY = "BUSY"
# Over UDP: a retry of a request whose answer the broker no longer
# remembers (a decimal id at or below one whose answer it forgot): it is
# not carried out again.
ANSWER_FORGOTTEN = "ANSWER_FORGOTTEN"

# Who may do what: a request before the client logged in (on a broker with
# --passwords), a login refused (a bad user name or password), a topic the
# ACL (--acl) refuses.
NOT_AUTHORIZED = "NOT_AUTHORIZED"
BAD_CREDENTIALS = "BAD_CREDENTIALS"
FORBIDDEN = "FORBIDDEN"
# Over TCP: the connection did not log in in time.
LOGIN_TIMEOUT = "LOGIN_TIMEOUT"
# Over TCP: as many requests in a row were refused as the broker allows.
TOO_MANY_ERRORS = "TOO_MANY_ERRORS"
# Over TCP: a frame begun was not complete in time.
FRAME_TIMEOUT = "FRAME_TIMEOUT"

# The errors after which the broker closes a TCP connection.
CLOSING = frozenset(
    (
        LINE_TOO_LONG,
        BAD_FRAMING,
        TOO_MANY_CLIENTS,
        BAD_CREDENTIALS,
        LOGIN_TIMEOUT,
        TOO_MANY_ERRORS,
        FRAME_TIMEOUT,
    )
)

# The errors that say what the broker cannot do now, not what the client
# did wrong: they do not count in a client's run of errors.
BROKER_STATE = frozenset((SHUTTING_DOWN, STORE_FAILED))

NO_ID = "-"


class RequestError(Exception):
    """
    A request that cannot be carried out, with the code and reason sent back.

    @ivar requestId: the id of the failed request, or C{"-"} when it had none
        (or none could be read).
    """

    def __init__(self, code, reason, requestId=NO_ID):
        Exception.__init__(self, code, reason, requestId)
        self.code = code
        self.reason = reason
        self.requestId = requestId

    def __str__(self):
        return f"{self.code}: {self.reason}"
