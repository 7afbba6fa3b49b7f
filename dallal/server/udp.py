"""
The broker over UDP: one L{BrokerDatagramProtocol} per port, one
L{UdpClient} per client.

UDP has no connections, so a client is known by the id it gives in its
C{HELLO}, and reached at the last address it was heard from with a valid
token.  Source addresses can be forged, so the broker:

 - answers a C{HELLO} with a token bound to the client id and the source
   address (an HMAC under a secret drawn at start: nothing is stored until
   the client echoes it), and starts a session only for a C{HELLO} that
   echoes it;
 - accepts every other request only with the client's id and token, which
   prove that the client receives at that address;
 - sends an address that has not proved it at most three times the bytes
   it received from it (QUIC's anti-amplification rule, RFC 9000 8.1), so
   that the broker cannot be used to flood a victim.

Each datagram holds one frame of the TCP format (L{dallal.protocol.datagram}); the
requests are carried out by the same L{RequestHandler} as over TCP, on the
same broker core.  A client pings the broker; one that falls silent is
expired by the broker's ping sweep.  PROTOCOL.md ("UDP") is the reference.

A client id names a session; it proves nothing.  The answer that starts a
session gives its client the session's key, and a session moves to another
address only for a C{HELLO} that echoes that key (or, on a broker that takes
passwords, logs in again as the session's user).  Every other request is
carried out only from the session's own address: a token for the client id
at another address (which anyone can ask for) names the session but does
not reach it.

On a broker that takes passwords, the C{HELLO} that echoes the token also
carries the client's credentials: its session starts only once they are
checked (L{dallal.security.auth.Gatekeeper}).
"""

import base64
import hashlib
import hmac
import os
import secrets
from collections import Counter, OrderedDict
from math import ceil

from twisted.internet.defer import CancelledError
from twisted.internet.error import MessageLengthError
from twisted.internet.protocol import DatagramProtocol
from zope.interface import implementer

from dallal import __version__
from dallal.broker.interfaces import ISubscriber
from dallal.errors import (
    ANSWER_FORGOTTEN,
    BAD_TOKEN,
    BUSY,
    NO_ID,
    NO_SESSION,
    NOT_AUTHORIZED,
    PAYLOAD_TOO_LARGE,
    SHUTTING_DOWN,
    RequestError,
)
from dallal.limits import (
    HELLO_RATE,
    LINE,
    UDP_ANSWER_BYTES,
    UDP_ANSWER_BYTES_TOTAL,
    UDP_CLIENTS,
    UDP_CLIENTS_PER_IP,
    ConnectionTable,
    LogWindow,
    RateTable,
)
from dallal.numbers import wholeNumber
from dallal.protocol import datagram, wire
from dallal.server.addresses import formatDatagramAddress
from dallal.server.keepalive import IPingable
from dallal.server.login import (
    PASSWORD_NEEDED,
    LoginRefused,
    checkPassword,
    loginRequired,
    userWithoutPassword,
)
from dallal.server.requests import RequestHandler, helloLimits

DEFAULT_ACK_TIMEOUT = 1.0

# An address that has not proved it receives is sent at most this many
# times the bytes it sent.
AMPLIFICATION_FACTOR = 3
# Addresses whose bytes are counted for that rule; the least recently heard
# is forgotten first (forgetting one never lets it be sent more than the
# factor allows: its count starts again from nothing).
MAX_UNPROVEN_ADDRESSES = 10_000
# Answers remembered per client, so that a retried request is answered
# again instead of being carried out twice.
REMEMBERED_ANSWERS = 1024
# What a remembered answer costs beyond the characters of its id and the
# bytes of its answer: those two objects' headers, the key tuple and the
# two ordered dictionaries' entries (some 330 bytes measured with
# tracemalloc on CPython 3, and room for the dictionaries' spare slots).
ANSWER_BOOKKEEPING = 384
# What is remembered for a retained PUB whose answer waits for the store.
AWAITING_STORE = object()
# What a retry gets whose answer was forgotten (AnswerCache.get).
FORGOTTEN = object()
# 96 bits of HMAC-SHA256: a forger gets one guess per datagram.
TOKEN_BYTES = 12
# Random bytes of a session's key (22 URL-safe base64 characters).
SESSION_KEY_BYTES = 16
# Seconds a login waits for its password check without its HELLO being
# resent: a client resends at least every second (dallal.client), so one
# silent this long is gone, and its check is dropped.
LOGIN_RESEND_TIMEOUT = 3.0
# How a login is written in a UDP client's HELLO.
LOGIN_USAGE = "HELLO <id> <client-id> token=<token> user=<name> password=<the password in base64>"
# Refusals of datagrams that named no session logged per second, at most.
STRANGER_ERRORS_LOGGED_PER_SECOND = 10


def datagramDelivery(delivery, ackTimeout):
    """
    The delivery limits of UDP sessions, from the broker's: a lost datagram
    is resent after C{ackTimeout}, for as long as a TCP client's message
    would be (C{maxAttempts} times the broker's own ack timeout), and a
    message must fit in a datagram.
    """
    maxPayload = datagram.MAX_PAYLOAD
    if delivery.maxPayload is not None:
        maxPayload = min(maxPayload, delivery.maxPayload)
    return delivery.replace(
        ackTimeout=ackTimeout,
        maxAttempts=max(
            delivery.maxAttempts,
            ceil(delivery.maxAttempts * delivery.ackTimeout / ackTimeout),
        ),
        maxPayload=maxPayload,
    )


class _Stranger:
    """
    Whoever sent a datagram that named no session, as the broker's log
    shows it.
    """

    __slots__ = ("peer",)
    transportName = "udp"

    def __init__(self, address):
        self.peer = formatDatagramAddress(address)


class StrangerErrorLog:
    """
    Counts and logs the refusals of datagrams that named no session.  Their
    source address may be forged, so they have a window of their own, of
    C{perSecond} events a second, within the broker's for all errors
    (L{dallal.limits.RateLimitedLog}, which reports those it did not log).
    """

    def __init__(self, broker, perSecond=STRANGER_ERRORS_LOGGED_PER_SECOND):
        self._broker = broker
        self._window = LogWindow(perSecond, seconds=1)

    def refused(self, address, code):
        logged = self._window.allow(self._broker.clock.seconds())
        self._broker.protocolError(_Stranger(address), code, False, logged=logged)


class AnswerCache:
    """
    The answers UDP sessions remember by request id: the last
    L{REMEMBERED_ANSWERS} of each session, within C{maxBytesPerSession}
    bytes per session and C{maxBytes} in all (each answer counted with its
    request id and L{ANSWER_BOOKKEEPING}).  The oldest are forgotten first, a session's
    own for its bound and anyone's for the total: a retry comes within
    seconds of its request.

    What is forgotten still leaves a mark: for each session, the highest
    decimal request id whose answer was forgotten.  A client that numbers
    its requests with increasing decimal integers (PROTOCOL.md, "Lost
    datagrams") sends a retry with an id at or below it only for a request
    already received, so such a retry is L{FORGOTTEN}, never carried out
    twice.

    @param forgotten: called with C{(session, limit, maximum)} for each
        answer forgotten for a byte bound.
    """

    def __init__(self, maxBytesPerSession, maxBytes, forgotten):
        self.maxBytesPerSession = maxBytesPerSession
        self.maxBytes = maxBytes
        self._forgotten = forgotten
        # session -> (request id -> answer), oldest first.
        self._sessions = {}
        # (session, request id) -> bytes counted, oldest first.
        self._order = OrderedDict()
        self._sessionBytes = Counter()
        self.bytes = 0
        # session -> the highest decimal request id whose answer was
        # forgotten for a bound.
        self._forgottenUpTo = {}

    def get(self, session, requestId):
        """
        The answer remembered for a request, L{FORGOTTEN} if it is a retry
        whose answer is forgotten, or C{None} for a request not seen.
        """
        answers = self._sessions.get(session)
        answer = None if answers is None else answers.get(requestId)
        if answer is None and requestId is not None:
            forgottenUpTo = self._forgottenUpTo.get(session)
            if forgottenUpTo is not None:
                number = wholeNumber(requestId, wire.MAX_ID_LENGTH)
                if number is not None and number <= forgottenUpTo:
                    return FORGOTTEN
        return answer

    def remember(self, session, requestId, answer):
        """
        Remember C{answer} (bytes, or L{AWAITING_STORE}) as the newest.
        """
        self._forget(session, requestId)
        size = (
            ANSWER_BOOKKEEPING + len(requestId) + (0 if answer is AWAITING_STORE else len(answer))
        )
        answers = self._sessions.setdefault(session, OrderedDict())
        answers[requestId] = answer
        self._order[session, requestId] = size
        self._sessionBytes[session] += size
        self.bytes += size
        if len(answers) > REMEMBERED_ANSWERS:
            self._evict(session, next(iter(answers)))
        while self._sessionBytes[session] > self.maxBytesPerSession:
            self._evict(session, next(iter(answers)))
            self._forgotten(session, UDP_ANSWER_BYTES, self.maxBytesPerSession)
        while self.bytes > self.maxBytes:
            oldest = next(iter(self._order))
            self._evict(*oldest)
            self._forgotten(oldest[0], UDP_ANSWER_BYTES_TOTAL, self.maxBytes)

    def replace(self, session, requestId, answer):
        """
        Remember a late answer in place of the one remembered, if it still
        is.
        """
        answers = self._sessions.get(session)
        if answers is not None and requestId in answers:
            self.remember(session, requestId, answer)

    def forgetSession(self, session):
        for requestId in list(self._sessions.get(session, ())):
            self._forget(session, requestId)
        self._forgottenUpTo.pop(session, None)

    def _evict(self, session, requestId):
        """
        Forget an answer for a bound, keeping its mark.
        """
        self._forget(session, requestId)
        number = wholeNumber(requestId, wire.MAX_ID_LENGTH)
        if number is not None and number > self._forgottenUpTo.get(session, -1):
            self._forgottenUpTo[session] = number

    def _forget(self, session, requestId):
        size = self._order.pop((session, requestId), None)
        if size is None:
            return
        answers = self._sessions[session]
        del answers[requestId]
        self._sessionBytes[session] -= size
        self.bytes -= size
        if not answers:
            del self._sessions[session]
            del self._sessionBytes[session]


@implementer(ISubscriber, IPingable)
class UdpClient(RequestHandler):
    """
    One UDP client, from its C{HELLO} until it expires or says C{BYE}.

    @ivar address: the C{(host, port)} it was last heard from with a valid
        token, where everything for it is sent.
    @ivar key: the session's secret, told only to the address that started
        or resumed it: a C{HELLO} that echoes it resumes the session at
        another address.
    """

    transportName = "udp"
    endOfErrorStreak = "ending the session"

    def __init__(self, protocol, clientId, address):
        self.protocol = protocol
        self.broker = protocol.broker
        self.clientId = clientId
        self.key = secrets.token_urlsafe(SESSION_KEY_BYTES)
        self.address = None
        self.peer = None
        # Who logged in (on a broker that takes passwords), and an HMAC of
        # the credentials, so that a HELLO that resends them resumes the
        # session without checking the password again.
        self.userName = None
        self.loginFingerprint = None
        self.moveTo(address)
        # The answers sent, for retries of their requests.
        self._answers = protocol.answers
        # The id of the request being carried out, and whether to remember
        # its answer.
        self._answering = NO_ID
        self._remember = False
        # Whether a subscriber this client publishes to has a full queue:
        # its PUBs are answered BUSY meanwhile.
        self._busy = False

    def moveTo(self, address):
        self.address = address
        self.peer = formatDatagramAddress(address)

    def mayMoveTo(self, address, key):
        """
        Whether a C{HELLO} from C{address} that echoed C{key} (text, or
        C{None}) may resume this session there: it is where the session
        is already, or the key is the session's.
        """
        return address == self.address or (
            key is not None and hmac.compare_digest(key.encode("utf-8"), self.key.encode("ascii"))
        )

    def requestReceived(self, request, rest):
        """
        Carry out a request of this client's, or answer a retry of one
        already carried out as it was answered then.

        @param rest: what followed the control line in the datagram.
        """
        requestId = getattr(request, "id", None)
        answer = self._answers.get(self, requestId)
        if answer is FORGOTTEN:
            self.broker.counters.count("duplicates")
            self.refuse(
                RequestError(
                    ANSWER_FORGOTTEN,
                    f"request {requestId} was received before, and its answer is no "
                    "longer remembered: it is not carried out again",
                    requestId,
                )
            )
            return
        if answer is not None:
            self.broker.counters.count("duplicates")
            if answer is not AWAITING_STORE:
                self.protocol.sendTo(answer, self.address)
            return
        self._answering = requestId or NO_ID
        self._remember = requestId is not None
        streak = self.errorStreak
        try:
            if type(request) is wire.Publish:
                if self._busy:
                    self._answerBusy(requestId)
                    return
                self.broker.checkPayloadSize(
                    self, request.size, request.id, self.protocol.maxPayload
                )
                self.publish(request, datagram.payloadOf(rest, request.size, request.id))
            else:
                datagram.checkNothingAfter(rest, self._answering)
                self.handleRequest(request)
        except RequestError as error:
            self.refuse(error)
        else:
            self.carriedOut(streak)
        finally:
            self._answering = NO_ID
            self._remember = False

    def _answerBusy(self, requestId):
        """
        Refuse a PUB while a subscriber it would reach has a full queue:
        nothing is published, nothing remembered, and the client's resend
        is judged again.  Counted, not logged: a burst makes thousands.
        """
        self.protocol.sendTo(
            wire.encodeError(
                requestId, BUSY, "a subscriber's queue is full: nothing published, resend later"
            ),
            self.address,
        )
        self.broker.counters.count("publishes_busy")
        self.broker.protocolError(self, BUSY, False, logged=False)

    # RequestHandler

    def sendFrame(self, *chunks):
        data = b"".join(chunks)
        if len(data) > datagram.MAX_DATAGRAM:
            # An answer with a payload (a long TOPICS, say) that no datagram
            # can carry: say so, rather than let the client resend in vain.
            self.refuse(
                RequestError(
                    PAYLOAD_TOO_LARGE,
                    f"the answer of {len(data)} bytes does not fit in a datagram",
                    self._answering,
                )
            )
            return
        if self._remember and len(chunks) == 1:
            # One-line answers (PUBACK, SUBACK, ...) are remembered; answers
            # with a payload (STATS, LIST, ...) are to read-only requests,
            # cheaper to answer afresh than to keep.
            self._rememberAnswer(self._answering, data)
        self.protocol.sendTo(data, self.address)

    def _rememberAnswer(self, requestId, answer):
        self._answers.remember(self, requestId, answer)

    def answerWhenStored(self, requestId, stored):
        # The message is already published; its answer comes once the store
        # is written, after this request was handled.  Until then a retry is
        # ignored (the answer is on its way), afterwards it gets the same
        # answer: a retried retained PUB is never published twice.  A store
        # failure is remembered too, since the message did go out.
        self._rememberAnswer(requestId, AWAITING_STORE)
        stored.addCallbacks(
            self._answerStored,
            self._answerNotStored,
            callbackArgs=(requestId,),
            errbackArgs=(requestId,),
        )

    def _answerStored(self, _, requestId):
        self._sendLateAnswer(requestId, wire.encodePubAck(requestId))

    def _answerNotStored(self, failure, requestId):
        failure.trap(RequestError)
        error = failure.value
        self._sendLateAnswer(requestId, wire.encodeError(requestId, error.code, error.reason))
        self.broker.protocolError(self, error.code, False)

    def _sendLateAnswer(self, requestId, answer):
        self._answers.replace(self, requestId, answer)
        self.protocol.sendTo(answer, self.address)

    def refuse(self, error, fatal=False):
        # A refused request is not remembered: its retry is judged again.
        self._remember = False
        RequestHandler.refuse(self, error, fatal)
        if fatal:
            self.disconnect("protocol_error")
        elif self.errorStreakOver(error) and self.protocol.serves(self):
            self.refuse(self.tooManyErrors(), fatal=True)

    def pongReceived(self):
        # The broker does not ping UDP clients: they ping it, and every
        # datagram they send with their token counts (see
        # BrokerDatagramProtocol.datagramReceived).
        pass

    # ISubscriber

    def sendMessage(self, message, subscriptionId, seq, deliveryId, redelivered):
        frame = wire.encodeMessage(message, subscriptionId, seq, deliveryId, redelivered)
        self.protocol.sendTo(b"".join(frame), self.address)

    def pausePublishing(self):
        self._busy = True

    def resumePublishing(self):
        self._busy = False

    def disconnect(self, reason):
        # Datagrams from the client find no session from now on; the broker,
        # which may be in the middle of a publish to this session, detaches
        # it on a later turn of the reactor, as a closing TCP connection is.
        self.protocol.forget(self)
        self.broker.clock.callLater(0, self.broker.detach, self, reason)

    # IPingable: the sweep checks that the client was heard from in each
    # interval.

    def sendPing(self):
        pass

    def pingMissed(self, missed):
        self.broker.pingMissed(self, missed)

    def keepaliveExpired(self, missed):
        self.broker.clientDropped(self, missed)
        self.protocol.endSession(self, "expired")


class BrokerDatagramProtocol(DatagramProtocol):
    """
    The broker's UDP port: authenticates datagrams and hands them to their
    client's L{UdpClient}.

    @param sweep: the broker's L{PingSweep}; its interval is the one UDP
        clients are told to ping at.
    @param ackTimeout: seconds before a message not acked is sent again.
    @param secret: the key of the tokens (random unless a test fixes it).
    """

    # The broker logs its own listening event; Twisted's would be noise.
    noisy = False

    def __init__(self, broker, sweep, ackTimeout=DEFAULT_ACK_TIMEOUT, secret=None, gatekeeper=None):
        """
        @param gatekeeper: the broker's L{dallal.security.auth.Gatekeeper}, or
            C{None} when it has neither passwords nor ACL.
        """
        self.broker = broker
        self.sweep = sweep
        self.gatekeeper = gatekeeper
        # (client id, address) of the logins being checked -> the delayed
        # call that drops the check if the client stops resending.
        self._loggingIn = {}
        self.ackTimeout = ackTimeout
        self.followConfig()
        self._secret = os.urandom(32) if secret is None else secret
        self._sessions = {}
        # How many sessions are at each address: those addresses have
        # proved they receive.
        self._sessionAddresses = Counter()
        # How many sessions there are, in all and at each host.
        config = self.broker.config
        self._clients = ConnectionTable(
            config.maxUdpClients,
            config.maxUdpClientsPerIp,
            (UDP_CLIENTS, UDP_CLIENTS_PER_IP),
            "UDP clients",
        )
        # (host, port) -> [bytes received, bytes sent], for the others.
        self._unproven = OrderedDict()
        # Hellos each source host may still say (each costs an HMAC).
        self._hellos = RateTable(broker.clock, broker.config.maxHellosPerSecond)
        self.answers = AnswerCache(
            broker.config.maxUdpAnswerBytes,
            broker.config.maxUdpAnswerBytesTotal,
            self._answerForgotten,
        )
        self._strangerErrors = StrangerErrorLog(broker)

    # Tokens

    def followConfig(self):
        """
        Take the broker's delivery settings and payload limit as they are
        now (at start, and when SIGHUP changes them): for the sessions that
        start next, and the payloads that come next.
        """
        config = self.broker.config
        self.delivery = datagramDelivery(config.delivery, self.ackTimeout)
        self.maxPayload = min(config.maxPayload, datagram.MAX_PAYLOAD)

    def token(self, clientId, address):
        """
        The token of a client id at an address.

        @param clientId: bytes.
        @return: bytes, 16 URL-safe base64 characters.
        """
        host, port = address[:2]
        mac = hmac.new(
            self._secret, b"%s|%s|%d" % (clientId, host.encode("ascii"), port), hashlib.sha256
        )
        return base64.urlsafe_b64encode(mac.digest()[:TOKEN_BYTES])

    def _tokenMatches(self, clientId, token, address):
        return hmac.compare_digest(self.token(clientId, address), token)

    # Sending, within the anti-amplification limit

    def sendTo(self, data, address, proven=False):
        """
        Send one datagram, unless the address has not proved it receives and
        this would take what it was sent over three times what it sent.

        @param proven: the datagram answered has a valid token, though its
            address has no session (yet): the address has proved it.
        """
        if not proven and address not in self._sessionAddresses:
            counts = self._unproven.get(address)
            if counts is None or counts[1] + len(data) > AMPLIFICATION_FACTOR * counts[0]:
                self.broker.counters.count("unsent")
                return
            counts[1] += len(data)
        try:
            self.transport.write(data, address)
        except (OSError, MessageLengthError):
            # The socket's buffer is full (or the address unreachable): the
            # datagram is lost, as on the network.  Acked deliveries are
            # resent; the count says how many were lost here.
            self.broker.counters.count("unsent")

    def _received(self, address, size):
        if address in self._sessionAddresses:
            return
        counts = self._unproven.get(address)
        if counts is None:
            if len(self._unproven) >= MAX_UNPROVEN_ADDRESSES:
                self._unproven.popitem(last=False)
            counts = self._unproven[address] = [0, 0]
        else:
            self._unproven.move_to_end(address)
        counts[0] += size

    def _answerForgotten(self, session, limit, maximum):
        self.broker.refusedByLimit(session, limit, maximum)

    def _refuse(self, error, address, proven=False):
        """
        Refuse a datagram that named no session.

        @param proven: see L{sendTo}.
        """
        self.sendTo(wire.encodeError(error.requestId, error.code, error.reason), address, proven)
        self._strangerErrors.refused(address, error.code)

    # Sessions

    def _settle(self, session, address):
        """
        The session's client proved it receives at C{address}: send there
        from now on.
        """
        self._unproven.pop(address, None)
        if session.address != address:
            self._leave(session.address)
            session.moveTo(address)
            self._arrive(address)
        self.sweep.pongReceived(session)

    def _arrive(self, address):
        self._sessionAddresses[address] += 1
        self._clients.opened(address[0])

    def _leave(self, address):
        self._sessionAddresses[address] -= 1
        if not self._sessionAddresses[address]:
            del self._sessionAddresses[address]
        self._clients.closed(address[0])

    def serves(self, session):
        """
        Whether C{session} is the one its client's datagrams find.
        """
        return self._sessions.get(session.clientId) is session

    def forget(self, session):
        """
        Stop serving a session: its client's datagrams find none.
        """
        if not self.serves(session):
            return
        del self._sessions[session.clientId]
        self._leave(session.address)
        self.sweep.remove(session)
        self.answers.forgetSession(session)

    def endSession(self, session, reason):
        """
        Forget a session and detach it from the broker.
        """
        self.forget(session)
        self.broker.detach(session, reason)

    # Datagrams

    def datagramReceived(self, data, address):
        self._received(address, len(data))
        line, rest = datagram.splitDatagram(data)
        maxLine = self.broker.config.maxControlLine
        if len(line) > maxLine:
            self._refuse(
                self.broker.refusedByLimit(
                    _Stranger(address), LINE, maxLine, f"control line longer than {maxLine} bytes"
                ),
                address,
            )
            return
        line, clientId, token = datagram.takeIdentity(line)
        try:
            request = wire.parseRequest(line)
        except RequestError as error:
            session = self._sessionAt(clientId, token, address)
            if session is None:
                self._refuse(error, address)
            else:
                # In the session's run of errors, as over TCP.
                self._settle(session, address)
                session.refuse(error)
            return
        if request is None:
            return
        if type(request) is wire.Hello:
            if self._hellos.allow(address[0]):
                self._helloReceived(request, rest, address)
            else:
                self.broker.refusedByLimit(
                    _Stranger(address), HELLO_RATE, self.broker.config.maxHellosPerSecond
                )
            return
        requestId = getattr(request, "id", NO_ID)
        if clientId is None or not self._tokenMatches(clientId, token, address):
            self._refuse(
                RequestError(
                    BAD_TOKEN,
                    "say HELLO: no token, or not this client's at this address",
                    requestId,
                ),
                address,
            )
            return
        # The token was made for this client id: it is printable ASCII.
        session = self._sessions.get(clientId.decode("ascii"))
        if session is None:
            self._refuse(
                RequestError(
                    NO_SESSION,
                    "this client has no session: it expired, or never said HELLO with its token",
                    requestId,
                ),
                address,
            )
            return
        if address != session.address:
            # A token for this client id at another address is anyone's for
            # the asking: it names the session, it does not prove holding it.
            self._refuse(
                RequestError(
                    BAD_TOKEN,
                    "this client's session is at another address: resume it from here "
                    "with HELLO <id> <client-id> token=<token> key=<its session key>",
                    requestId,
                ),
                address,
                proven=True,
            )
            return
        self._settle(session, address)
        if type(request) is wire.Bye:
            # Answered as over TCP; a client need not wait for it.
            session.sendFrame(wire.BYE_FRAME)
            self.endSession(session, "closed")
            return
        session.requestReceived(request, rest)

    def _sessionAt(self, clientId, token, address):
        """
        The session a datagram names with its client's token, if the
        datagram comes from the session's address; else C{None}.
        """
        if clientId is None or not self._tokenMatches(clientId, token, address):
            return None
        session = self._sessions.get(clientId.decode("ascii"))
        if session is None or session.address != address:
            return None
        return session

    def _helloReceived(self, hello, rest, address):
        """
        Without a token: answer with the token for this client id and
        address.  With it: start the client's session, or resume it here.
        """
        try:
            datagram.checkNothingAfter(rest, hello.id)
        except RequestError as error:
            self._refuse(error, address)
            return
        clientId = hello.clientId.encode("ascii")
        echoed = hello.options.get("token")
        if echoed is None:
            token = self.token(clientId, address).decode("ascii")
            self.sendTo(wire.encodeHelloReply(hello.id, {"token": token}), address)
            return
        if not self._tokenMatches(clientId, echoed.encode("utf-8"), address):
            self._refuse(
                RequestError(BAD_TOKEN, "not this client's token at this address", hello.id),
                address,
            )
            return
        try:
            credentials = wire.credentialsOf(hello)
        except RequestError as error:
            self._refuse(error, address, proven=True)
            return
        session = self._sessions.get(hello.clientId)
        if session is not None and session.mayMoveTo(address, hello.options.get("key")):
            # The session's own address, or its key: it resumes as it is.
            self._startSession(hello, address)
            return
        passwordNeeded = self.gatekeeper is not None and self.gatekeeper.loginRequired
        if session is not None and not (passwordNeeded and credentials is not None):
            # Only its key, or a login as its user, moves a session: its
            # client id is no secret.
            self._refuse(
                RequestError(
                    NOT_AUTHORIZED,
                    "this client id names a session at another address: resume it with "
                    "key=<its session key>, or choose another client id",
                    hello.id,
                ),
                address,
                proven=True,
            )
            return
        user = userWithoutPassword(self.gatekeeper, hello.clientId)
        if user is not PASSWORD_NEEDED:
            self._startSession(hello, address, user)
        elif credentials is None:
            self._refuse(loginRequired(LOGIN_USAGE, hello.id), address, proven=True)
        else:
            self._logIn(hello, address, credentials)

    def _startSession(self, hello, address, user=None, fingerprint=None):
        """
        Start the client's session, or resume it at this address, and
        answer its HELLO.

        @param user: the L{dallal.security.auth.IBrokerUser} it goes on as (a new
            session only), or C{None} on a broker without passwords or ACL.
        @param fingerprint: the HMAC of the credentials it logged in with.
        """
        session = self._sessions.get(hello.clientId)
        resumed = session is not None
        if not resumed and self.broker.shuttingDown:
            self._refuse(
                RequestError(SHUTTING_DOWN, "the broker is shutting down", hello.id), address
            )
            return
        if not resumed:
            if self._refusedByClientLimits(hello, address):
                return
            session = UdpClient(self, hello.clientId, address)
            self._sessions[hello.clientId] = session
            self._arrive(address)
            self.broker.attach(session, self.delivery)
            if user is not None:
                session.userName = user.name
                self.broker.login(session, user)
            self.sweep.add(session)
        if fingerprint is not None:
            session.loginFingerprint = fingerprint
        self._settle(session, address)
        options = {
            "token": hello.options["token"],
            "version": __version__,
            "ping": f"{self.sweep.interval:g}",
            **helloLimits(self.broker.config, self.maxPayload),
            "key": session.key,
            "session": "resumed" if resumed else "new",
        }
        if session.userName is not None:
            options["user"] = session.userName
        session.sendFrame(wire.encodeHelloReply(hello.id, options))

    def _refusedByClientLimits(self, hello, address):
        """
        Refuse a HELLO that would start a session over C{--max-udp-clients}
        or, from its host, over C{--max-udp-clients-per-ip}.

        @return: whether it was refused.
        """
        refusal = self._clients.refusal(address[0])
        if refusal is None:
            return False
        limit, maximum, reason = refusal
        self._refuse(
            self.broker.refusedByLimit(_Stranger(address), limit, maximum, reason, hello.id),
            address,
            proven=True,
        )
        return True

    # Logins

    def _fingerprint(self, user, password):
        return hmac.new(
            self._secret, b"login|%s|%s" % (user.encode("utf-8"), password), hashlib.sha256
        ).digest()

    def _logIn(self, hello, address, credentials):
        """
        Check a client's credentials, then start or resume its session.
        """
        fingerprint = self._fingerprint(*credentials)
        session = self._sessions.get(hello.clientId)
        if session is not None and session.loginFingerprint is not None:
            if hmac.compare_digest(session.loginFingerprint, fingerprint):
                # The client logged in with these before: it resumes (or
                # resent its HELLO because our answer was lost).
                self._startSession(hello, address)
                return
        attempt = (hello.clientId, address)
        senderGone = self._loggingIn.get(attempt)
        if senderGone is not None:
            # A resend while its password is checked: the client is still
            # there, and the first gets the answer.
            senderGone.reset(LOGIN_RESEND_TIMEOUT)
            return
        checking = checkPassword(
            self.broker,
            self.gatekeeper,
            credentials,
            hello.clientId,
            address[0],
            hello.id,
            lambda: self._answering(hello, address),
        )
        self._loggingIn[attempt] = self.broker.clock.callLater(
            LOGIN_RESEND_TIMEOUT, self._loginAbandoned, attempt, checking
        )
        checking.addCallbacks(
            self._loginSucceeded,
            self._loginFailed,
            callbackArgs=(hello, address, fingerprint),
            errbackArgs=(hello, address),
        )

    def _loginAbandoned(self, attempt, checking):
        """
        The client stopped resending its HELLO while its password waited
        to be checked: it is gone (or spoofed once and left), so its check
        leaves the queue unrun, or its answer is dropped.
        """
        del self._loggingIn[attempt]
        self.broker.counters.count("logins_abandoned")
        checking.cancel()

    def _loginAnswered(self, hello, address):
        """
        A login's check is over: stop watching for its client's resends.
        """
        senderGone = self._loggingIn.pop((hello.clientId, address), None)
        if senderGone is not None and senderGone.active():
            senderGone.cancel()

    def _loginSucceeded(self, user, hello, address, fingerprint):
        self._loginAnswered(hello, address)
        if self.transport is None:
            # The port stopped while the password was checked.
            return
        session = self._sessions.get(hello.clientId)
        if session is not None and session.userName != user.name:
            self._refuse(
                RequestError(
                    NOT_AUTHORIZED,
                    "this client id names another user's session: choose another",
                    hello.id,
                ),
                address,
                proven=True,
            )
            return
        self._startSession(hello, address, user, fingerprint)

    def _answering(self, hello, address):
        """
        Who answers a refused login: the session of its client id if the
        login came from the session's address, else whoever sent it; nobody
        once the port has stopped.
        """
        if self.transport is None:
            return None
        session = self._sessions.get(hello.clientId)
        if session is None or session.address != address:
            # The log names a session only for an attempt from its address.
            return _Stranger(address)
        return session

    def _loginFailed(self, failure, hello, address):
        self._loginAnswered(hello, address)
        if failure.check(CancelledError):
            # Abandoned, or the port stopped: nobody to answer.
            return
        failure.trap(LoginRefused)
        self._refuse(failure.value.error, address, proven=True)
