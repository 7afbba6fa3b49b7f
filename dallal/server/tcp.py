"""
The broker over TCP: one L{BrokerProtocol} per connection.

The protocol parses and frames; the L{Broker} core decides.  It never writes
to a connection that is closed or closing, and answers every bad request
with an C{ERR} frame; PROTOCOL.md says which errors also close it.  What a
request does is the same as over UDP: L{RequestHandler}.

On a broker that takes passwords, a connection serves nothing but C{HELLO},
C{PING}, C{PONG} and C{BYE} until its C{HELLO} logs it in
(L{dallal.security.auth.Gatekeeper}).
"""

from twisted.internet.defer import CancelledError
from twisted.internet.interfaces import ISSLTransport
from twisted.internet.protocol import Protocol, ServerFactory
from zope.interface import implementer

from dallal import __version__
from dallal.broker.interfaces import IRunSubscriber
from dallal.errors import (
    BAD_ARGUMENTS,
    BAD_FRAMING,
    LOGIN_TIMEOUT,
    NO_ID,
    NOT_AUTHORIZED,
    RequestError,
)
from dallal.limits import (
    FRAME_SECONDS,
    LINE,
    ConnectionTable,
)
from dallal.protocol import wire
from dallal.protocol.framing import FrameReceiver
from dallal.server.addresses import formatAddress
from dallal.server.keepalive import IPingable
from dallal.server.login import (
    PASSWORD_NEEDED,
    LoginRefused,
    checkPassword,
    loginRequired,
    userWithoutPassword,
)
from dallal.server.origins import originOptions
from dallal.server.requests import RequestHandler, helloLimits
from dallal.server.streams import (
    CONGESTION,
    LOGIN_CHECK,
    RUN_BYTES,
    TURN_OVER,
    BoundedOutput,
    ReadPause,
    WriteBatch,
)

# Seconds a refused connection is given to read its ERR and close.
REFUSAL_GRACE = 2.0

# Seconds of work one connection's pipelined requests get in a turn of the
# reactor: then the rest waits for the next turn, after the other
# connections' reads, so that a client pipelining costly requests delays
# the others by this much rather than by a whole read's worth.
TURN_SECONDS = 0.01


# What a client may send before it has logged in.
_BEFORE_LOGIN = frozenset({wire.Hello, wire.Bye, wire.Ping, wire.Pong})

LOGIN_USAGE = "HELLO <id> <client-id> user=<name> password=<the password in base64>"


@implementer(IRunSubscriber, IPingable)
class BrokerProtocol(FrameReceiver, RequestHandler, BoundedOutput):
    """
    One TCP client of the broker.

    @param gatekeeper: the broker's L{dallal.security.auth.Gatekeeper}, or C{None}
        when it has neither passwords nor ACL.
    """

    transportName = "tcp"
    peer = "?"
    carriesBridges = True

    def __init__(self, broker, sweep, gatekeeper=None, batch=None, connections=None, host=None):
        """
        @param gatekeeper: the broker's L{dallal.security.auth.Gatekeeper}, if any.
        @param batch: the L{WriteBatch} its writes join, shared by the
            factory's connections (a new one if C{None}).
        @param connections: the L{ConnectionTable} this connection counts
            in while it is open, if any.
        @param host: the client's address, as the table counts it.
        """
        self.broker = broker
        self.sweep = sweep
        self.gatekeeper = gatekeeper
        self.batch = batch if batch is not None else WriteBatch()
        self.MAX_LENGTH = broker.config.maxControlLine
        self._connections = connections
        self._host = host
        self._attached = False
        self._publishing = None
        self._closeReason = "closed"
        # Whether requests are served: at once, unless the broker takes
        # passwords; then from a successful login on.
        self._loggedIn = gatekeeper is None or not gatekeeper.loginRequired
        self._userName = None
        self._loginDeadline = None
        # Why reading from the client is paused: it reads again when no
        # reason is left.
        self.readPause = ReadPause()
        # The login whose password is being checked (a Deferred).
        self._checking = None
        # When the partial frame received must be complete by (a delayed
        # call), and how many frames were complete when it was set.
        self._frameDeadline = None
        self._framesBeforeDeadline = 0
        # When this connection's turn began (see TURN_SECONDS).
        self._turnStarted = 0.0
        # The delivery ids of the ACKs read since the last request of
        # another kind: a read's acks go to the broker together.
        self._acked = []

    def outputSubscriber(self):
        """
        Whose deliveries a full write buffer holds: this connection's, from
        when it is made until it is lost, or the broker's shutdown ends its
        session.
        """
        return self if self._attached else None

    def connectionMade(self):
        if self._connections is not None:
            self._connections.opened(self._host)
        self.peer = formatAddress(self.transport.getPeer())
        self._attached = True
        self.broker.attach(self)
        self.sweep.add(self)
        self.startOutput()
        if self.gatekeeper is not None and not self.gatekeeper.loginRequired:
            # Anonymous under the ACL; a HELLO may give the client id its
            # %c patterns need.
            self.broker.login(self, self.gatekeeper.anonymous())
        if not self._loggedIn:
            self._loginDeadline = self.gatekeeper.clock.callLater(
                self.gatekeeper.loginTimeout, self._loginTimedOut
            )

    def connectionLost(self, reason):
        self.dropOutput()
        # However the connection ended, it frees its place (the broker's
        # shutdown detaches the session first).
        connections, self._connections = self._connections, None
        if connections is not None:
            connections.closed(self._host)
        self._stopLoginDeadline()
        self._stopFrameDeadline()
        if self._checking is not None:
            # Nobody is left to log in: a check still waiting is dropped.
            self._checking.cancel()
        if self._attached:
            self._attached = False
            self.sweep.remove(self)
            self.broker.detach(self, self._closeReason)

    # RequestHandler

    def sendFrame(self, *chunks):
        if self._attached and not self.transport.disconnecting:
            self._write(chunks)

    def refuse(self, error, fatal=False):
        RequestHandler.refuse(self, error, fatal)
        if fatal:
            self._closeReason = "protocol_error"
            self.closeAfterOutput()
            return
        if self.errorStreakOver(error) and not self.transport.disconnecting:
            self.refuse(self.tooManyErrors(), fatal=True)

    def _carriedOut(self, streak):
        """
        A request was handled: if nothing of it was refused (the streak is
        still C{streak}), the client's run of errors is over.  If this
        connection's turn is over, the rest of what it sent waits for the
        next turn of the reactor.
        """
        # RequestHandler.carriedOut, inline: this runs once per request.
        if self.errorStreak == streak:
            self.errorStreak = 0
        clock = self.broker.clock
        if clock.seconds() - self._turnStarted > TURN_SECONDS and not self.readPause:
            self.pauseReading(TURN_OVER)
            clock.callLater(0, self.resumeReading, TURN_OVER)

    def pongReceived(self):
        self.sweep.pongReceived(self)

    # Runs of PUBs (FrameReceiver.runReceived)

    runStart = b"PUB "

    def runReceived(self, buffer, position):
        """
        Publish the plain PUBs (L{wire.PLAIN_PUB}: no options) on one
        topic that begin at C{position} of C{buffer}, each complete with
        its payload, up to L{RUN_BYTES} of them, without reading each as a
        frame, when nothing can refuse them (L{Broker.acceptsRun}) and
        nothing of this connection (a login to come, a run of errors)
        wants each read on its own.  They are published together, and
        acked in one write, when the broker's router takes them as a run
        (L{Broker.runReceivers}); else one by one, as their frames would
        be, until reading pauses.  A frame that is not one of them
        (options, another topic, a payload too large or not all read)
        ends the run, and is read as any other.

        @return: where the frames published end; C{position} if none was.
        """
        if not self._loggedIn or self.errorStreak or not self._attached:
            return position
        match = wire.PLAIN_PUB.match(buffer, position)
        if match is None:
            return position
        requestId, wireTopic, size = match.groups()
        try:
            topic = wireTopic.decode("utf-8")
        except UnicodeDecodeError:
            return position
        broker = self.broker
        if not broker.acceptsRun(self, topic):
            return position
        frames = self._plainPublishes(buffer, position, match, wireTopic)
        receivers = broker.runReceivers(self, topic)
        if receivers is not None:
            requestIds = []
            payloads = []
            for requestId, payload, end in frames:
                requestIds.append(requestId)
                payloads.append(payload)
                position = end
            if payloads:
                self.framesReceived += 2 * len(payloads)
                broker.publishRun(topic, wireTopic, payloads, receivers)
                self.sendFrame(wire.encodePubAcks(requestIds))
                self._carriedOut(0)
            return position
        # Each parsed as it is published: reading may pause after any.
        for requestId, payload, end in frames:
            position = end
            self.framesReceived += 2
            broker.publishAccepted(self, topic, payload)
            self.sendFrame(b"PUBACK %s\r\n" % (requestId,))
            self._carriedOut(0)
            if self.paused or self.transport.disconnecting or not self._attached:
                break
        return position

    def _plainPublishes(self, buffer, position, match, wireTopic):
        """
        The plain PUBs on C{wireTopic} from C{position} of C{buffer}, the
        first matched as C{match}, as long as each is complete and within
        the broker's limits, up to L{RUN_BYTES} of them.

        @return: an iterator of their request ids (as bytes), payloads and
            where each ends.
        """
        # A line longer than this is refused by the frame-by-frame reading.
        longestLine = self.MAX_LENGTH + 1
        maxPayload = self.broker.config.maxPayload
        runEnd = position + RUN_BYTES
        while True:
            requestId, topic, size = match.groups()
            lineEnd = match.end()
            size = int(size)
            payloadEnd = lineEnd + size
            if (
                topic != wireTopic
                or lineEnd - position > longestLine
                or size > maxPayload
                or not buffer.startswith(b"\r\n", payloadEnd)
            ):
                return
            position = payloadEnd + 2
            yield requestId, buffer[lineEnd:payloadEnd], position
            if position >= runEnd:
                return
            match = wire.PLAIN_PUB.match(buffer, position)
            if match is None:
                return

    # Incoming frames

    def pauseReading(self, reason):
        """
        Read nothing more for C{reason}: neither from the transport (the
        kernel's buffers fill, and TCP's window closes on the peer) nor
        what was read and not yet handled (L{LineReceiver}'s paused state),
        so that the pause takes effect after the frame being handled.
        """
        if self.readPause.add(reason):
            self.pauseProducing()
            # A frame left half-read meanwhile is not the client's delay.
            self._stopFrameDeadline()

    def resumeReading(self, reason):
        """
        C{reason} is gone: read again if it was the last.
        """
        if self.readPause.discard(reason) and not self.transport.disconnecting:
            self.resumeProducing()

    def dataReceived(self, data):
        # Any bytes prove the client alive: the sweep need not ping it.  (A
        # resumed reading hands over what was read before, as b"".)
        if data:
            self.sweep.heardFrom(self)
        self._turnStarted = self.broker.clock.seconds()
        why = self.batch.run(self._receive, data)
        self._watchPartialFrame()
        return why

    def _receive(self, data):
        why = FrameReceiver.dataReceived(self, data)
        if self._acked:
            self._acknowledgeRead()
        return why

    def _acknowledgeRead(self):
        """
        Hand the broker the ACKs read since the last request of another
        kind, together: what they held back is sent once.
        """
        acked, self._acked = self._acked, []
        if self._attached:
            self.broker.acknowledgeAll(self, acked)

    def _watchPartialFrame(self):
        """
        Give a frame begun C{maxFrameSeconds} to be complete.  The time
        runs from the end of the last complete frame, and only while the
        broker reads from the client: a read held (for a password check, or
        a full transport) is the broker's doing.
        """
        if self.paused or self.transport.disconnecting or not self.partialFrame():
            self._stopFrameDeadline()
        elif self._frameDeadline is None:
            self._framesBeforeDeadline = self.framesReceived
            self._frameDeadline = self.broker.clock.callLater(
                self.broker.config.maxFrameSeconds, self._frameTimedOut
            )
        elif self.framesReceived != self._framesBeforeDeadline:
            self._framesBeforeDeadline = self.framesReceived
            self._frameDeadline.reset(self.broker.config.maxFrameSeconds)

    def _stopFrameDeadline(self):
        if self._frameDeadline is not None:
            if self._frameDeadline.active():
                self._frameDeadline.cancel()
            self._frameDeadline = None

    def _frameTimedOut(self):
        self._frameDeadline = None
        maximum = self.broker.config.maxFrameSeconds
        self.refuse(
            self.broker.refusedByLimit(
                self,
                FRAME_SECONDS,
                maximum,
                f"a frame begun was not complete within {maximum} seconds",
                self._publishing.id if self._publishing else NO_ID,
            ),
            fatal=True,
        )

    def lineReceived(self, line):
        if not self._attached:
            # Detached by the broker's shutdown while the connection drains:
            # there is no session left to act for.
            return
        if line.startswith(b"ACK ") and self._loggedIn:
            deliveryId = line[4:]
            if deliveryId.isdigit() and len(deliveryId) <= wire.MAX_ID_LENGTH:
                # An ACK of an id as the broker gives them: taken with the
                # others of this read, before any other request.
                self._acked.append(deliveryId.decode("ascii"))
                self._carriedOut(self.errorStreak)
                return
        if self._acked:
            self._acknowledgeRead()
        try:
            request = wire.parseRequest(line)
        except RequestError as error:
            self.refuse(error)
            return
        if request is None:
            return
        kind = type(request)
        if not self._loggedIn and kind not in _BEFORE_LOGIN:
            self._refuseBeforeLogin(request)
            return
        streak = self.errorStreak
        if kind is wire.Publish:
            # Carried out, or not, once its payload is read.
            self._publishReceived(request)
            return
        if kind is wire.Hello:
            self._helloReceived(request)
        elif kind is wire.Bye:
            self._byeReceived()
        else:
            self.handleRequest(request)
        self._carriedOut(streak)

    def _refuseBeforeLogin(self, request):
        self.refuse(
            RequestError(
                NOT_AUTHORIZED,
                f"log in first: {LOGIN_USAGE}",
                getattr(request, "id", NO_ID),
            )
        )
        if type(request) is wire.Publish:
            self.expectPayload(request.size, discard=True)

    def _helloReceived(self, hello):
        """
        The hello over TCP: log the client in if it gives credentials and
        the broker takes passwords (which makes it required), and tell the
        client the broker's limits.
        """
        try:
            credentials = wire.credentialsOf(hello)
        except RequestError as error:
            self.refuse(error)
            return
        user = userWithoutPassword(self.gatekeeper, hello.clientId)
        if user is not PASSWORD_NEEDED:
            if user is not None:
                # No passwords: credentials are not checked, and the client
                # goes on anonymously, now with its client id.
                self.broker.login(self, user)
            self._answerHello(hello)
        elif self._loggedIn:
            if credentials is None:
                self._answerHello(hello)
            else:
                self.refuse(
                    RequestError(
                        BAD_ARGUMENTS,
                        f"already logged in as {self._userName}: connect again to "
                        "log in as another user",
                        hello.id,
                    )
                )
        elif credentials is None:
            self.refuse(loginRequired(LOGIN_USAGE, hello.id))
        else:
            # Read nothing more until the password is checked: requests
            # pipelined after the HELLO are then served, or not, as the
            # login decides.  Its pongs are not read meanwhile, so the
            # sweep leaves it alone until then.
            self.pauseReading(LOGIN_CHECK)
            self.sweep.remove(self)
            checking = self._checking = checkPassword(
                self.broker,
                self.gatekeeper,
                credentials,
                hello.clientId,
                self._host,
                hello.id,
                self._answering,
            )
            checking.addCallbacks(self._loginSucceeded, self._loginFailed, callbackArgs=(hello,))

    def _answering(self):
        """
        Who answers a refused login: this connection, unless it is gone.
        """
        return self if self._attached else None

    def _loginSucceeded(self, user, hello):
        self._checking = None
        if not self._attached:
            return
        self._stopLoginDeadline()
        self._loggedIn = True
        self._userName = user.name
        self.broker.login(self, user)
        self._answerHello(hello)
        self.sweep.add(self)
        self.resumeReading(LOGIN_CHECK)

    def _loginFailed(self, failure):
        """
        Refuse the login and close the connection, as Mosquitto does: a
        client has one try per connection.
        """
        self._checking = None
        if failure.check(CancelledError):
            # The connection was lost while its check waited.
            return
        failure.trap(LoginRefused)
        self._stopLoginDeadline()
        self.refuse(failure.value.error, fatal=True)

    def _loginTimedOut(self):
        self._loginDeadline = None
        if LOGIN_CHECK in self.readPause or not self._attached:
            # Its password is being checked: the check decides.
            return
        self.refuse(
            RequestError(
                LOGIN_TIMEOUT,
                f"no login within {self.gatekeeper.loginTimeout:g} seconds of connecting",
            ),
            fatal=True,
        )

    def _stopLoginDeadline(self):
        if self._loginDeadline is not None and self._loginDeadline.active():
            self._loginDeadline.cancel()
        self._loginDeadline = None

    def _answerHello(self, hello):
        """
        Tell the client the broker's limits, and the user it is logged in as.
        """
        config = self.broker.config
        options = {
            "version": __version__,
            "ping": f"{self.sweep.interval:g}",
            **helloLimits(config, config.maxPayload),
        }
        if self._userName is not None:
            options["user"] = self._userName
        self.sendFrame(wire.encodeHelloReply(hello.id, options))

    def _byeReceived(self):
        """
        A graceful disconnect: answer BYE, then close once it is written.
        """
        self.sendFrame(wire.BYE_FRAME)
        self.closeAfterOutput()

    def _publishReceived(self, request):
        try:
            self.broker.checkPayloadSize(self, request.size, request.id)
        except RequestError as error:
            # Skip the payload without storing it, so the stream stays framed.
            self.refuse(error)
            self.expectPayload(request.size, discard=True)
            return
        self._publishing = request
        self.expectPayload(request.size)

    def payloadReceived(self, payload):
        request, self._publishing = self._publishing, None
        if not self._attached:
            return
        streak = self.errorStreak
        self.publish(request, payload)
        self._carriedOut(streak)

    def payloadTerminatorMissing(self):
        self.refuse(
            RequestError(
                BAD_FRAMING,
                "payload not followed by a line end: its size was wrong",
                self._publishing.id if self._publishing else NO_ID,
            ),
            fatal=True,
        )

    def lineLengthExceeded(self, line):
        # Fatal: the line may have announced a payload, so where the next
        # frame starts is unknown.
        self.refuse(
            self.broker.refusedByLimit(
                self, LINE, self.MAX_LENGTH, f"control line longer than {self.MAX_LENGTH} bytes"
            ),
            fatal=True,
        )

    # ISubscriber

    def sendMessage(self, message, subscriptionId, seq, deliveryId, redelivered):
        if self._attached and not self.transport.disconnecting:
            if self.bridging:
                frame = wire.encodeMessageWithOptions(
                    message,
                    subscriptionId,
                    seq,
                    deliveryId,
                    redelivered,
                    originOptions(self.broker.originOf(message)),
                )
            else:
                frame = wire.encodeMessage(message, subscriptionId, seq, deliveryId, redelivered)
            self._write(frame)

    @property
    def takesRuns(self):
        """
        Whether runs of messages may be written with L{sendMessageRun}: not
        to a bridge, whose every message carries its origin.
        """
        return not self.bridging

    def sendMessageRun(self, topic, wireTopic, payloads, subscriptionId, firstSeq):
        """
        Write a run of messages on one topic to a C{fire} subscription at
        once (L{dallal.broker.router.Router.publishRun}).
        """
        if self._attached and not self.transport.disconnecting:
            self._write((wire.encodeMessageRun(wireTopic, payloads, subscriptionId, firstSeq),))

    def pausePublishing(self):
        self.pauseReading(CONGESTION)

    def resumePublishing(self):
        self.resumeReading(CONGESTION)

    def disconnect(self, reason):
        self._closeReason = reason
        if reason == "shutdown":
            # The broker has already detached this session.
            self._attached = False
            self.sweep.remove(self)
            self.closeAfterOutput()
        else:
            # A slow consumer's buffer may never drain: don't wait for it.
            self.dropOutput()
            self.transport.abortConnection()

    # IPingable

    def sendPing(self):
        if CONGESTION in self.readPause:
            # Not read because a subscriber is full, for as long as that
            # subscriber makes progress: its PONG could not be read, so its
            # silence proves nothing.
            self.sweep.heardFrom(self)
            return
        self.sendFrame(wire.PING_FRAME)

    def pingMissed(self, missed):
        self.broker.pingMissed(self, missed)

    def keepaliveExpired(self, missed):
        self.broker.clientDropped(self, missed)
        self._closeReason = "missed_pings"
        # The peer is not answering, so it may not be reading either: do not
        # wait for the write buffer to drain.
        self.dropOutput()
        self.transport.abortConnection()


class RefusedConnection(Protocol):
    """
    A connection over the broker's limits: it is sent the C{ERR}, then
    closed (as Redis answers C{-ERR max number of clients reached}).

    The broker stops writing, but reads until the client closes (or
    L{REFUSAL_GRACE} is over): closing a socket with unread bytes, such as
    the first request a client sent at once, would make the kernel reset
    the connection and the client might never read its C{ERR}.
    """

    def __init__(self, error, clock):
        self.error = error
        self.clock = clock
        self._deadline = None

    def connectionMade(self):
        self.transport.write(wire.encodeError(NO_ID, self.error.code, self.error.reason))
        halfClose = getattr(self.transport, "loseWriteConnection", None)
        if halfClose is None or ISSLTransport.providedBy(self.transport):
            # TLS sends the ERR once its handshake is done, then closes.  It
            # has no half-close: the loseWriteConnection it seems to have is
            # the TCP connection's under it, which would cut the handshake.
            self.transport.loseConnection()
        else:
            halfClose()
        self._deadline = self.clock.callLater(REFUSAL_GRACE, self.transport.abortConnection)

    def dataReceived(self, data):
        pass

    def connectionLost(self, reason):
        if self._deadline is not None and self._deadline.active():
            self._deadline.cancel()


class BrokerFactory(ServerFactory):
    """
    Builds a L{BrokerProtocol} for each connection to one broker, or a
    L{RefusedConnection} over the broker's connection limits.

    @ivar connections: the L{ConnectionTable} of its connections, however
        many endpoints it serves.
    """

    # The broker logs its own listening event; Twisted's would be noise.
    noisy = False

    def __init__(self, broker, sweep, gatekeeper=None):
        self.broker = broker
        self.sweep = sweep
        self.gatekeeper = gatekeeper
        # One for all the connections: a read of one may write to many.
        self.batch = WriteBatch()
        config = broker.config
        self.connections = ConnectionTable(config.maxConnections, config.maxConnectionsPerIp)

    def buildProtocol(self, addr):
        # A UNIX socket's peer has no host: only the total applies to it.
        host = getattr(addr, "host", None)
        refusal = self.connections.refusal(host)
        if refusal is None:
            protocol = BrokerProtocol(
                self.broker, self.sweep, self.gatekeeper, self.batch, self.connections, host
            )
        else:
            limit, maximum, reason = refusal
            error = self.broker.refusedPeer(
                limit, maximum, formatAddress(addr), BrokerProtocol.transportName, reason=reason
            )
            protocol = RefusedConnection(error, self.broker.clock)
        protocol.factory = self
        return protocol
