"""
A client of a broker over UDP (PROTOCOL.md, "UDP"): L{connectUDP}.
"""

import secrets
from collections import OrderedDict

from twisted.internet.abstract import isIPAddress, isIPv6Address
from twisted.internet.defer import Deferred
from twisted.internet.error import ConnectionDone, MessageLengthError
from twisted.internet.protocol import DatagramProtocol
from twisted.internet.task import LoopingCall
from twisted.python.failure import Failure

from dallal.client.base import ClientBase, loginOptions
from dallal.client.errors import ClientProtocolError, ServerError, SessionLost
from dallal.errors import BAD_TOKEN, BUSY, NO_SESSION, RequestError
from dallal.protocol import datagram, wire
from dallal.topics import MAX_TOPIC_LENGTH

# Resending a request over UDP: after this many seconds, then twice as long
# each time, up to RETRY_MAX_DELAY.
RETRY_FIRST_DELAY = 0.25
RETRY_MAX_DELAY = 1.0
# Requests a UDP client has unanswered at once, and the span of their ids:
# a request whose id is this far past the oldest unanswered one waits.  The
# broker remembers the answers to more than twice as many of a session's
# requests (PROTOCOL.md, "Lost datagrams"), so a resend always finds its
# answer there, however many requests were answered since.
REQUEST_WINDOW = 64
# A HELLO is padded to this size: the broker answers an address that has
# not yet proved it receives with at most three times what it sent.
HELLO_SIZE = 64


class DallalDatagramClient(DatagramProtocol, ClientBase):
    """
    A client of a broker over UDP (see L{connectUDP}).

    Its socket is not connected: on Linux an ICMP "port unreachable" on a
    connected UDP socket closes Twisted's port, and this client must keep
    going while the broker is away.  It reads only what comes from the
    broker's address, as a connected socket would.

    @ivar clientId: who this client is to the broker: random unless given.
        A client that restarts must not reuse it while its old session may
        still be alive: the broker keeps the id for that session.
    @ivar sessionKey: the session's secret, from the broker's answer to the
        HELLO that started it: the HELLO that resumes the session from a new
        address echoes it.
    @ivar pingInterval: seconds between pings, as the broker asked.
    @ivar maxPayload: the largest payload the broker accepts over UDP.
    """

    def __init__(self, clock, brokerAddress, clientId=None, onPongMissed=None, credentials=None):
        """
        @param brokerAddress: the broker's C{(ip, port)}.
        @param onPongMissed: called as C{onPongMissed(missed)} when a ping
            has gone unanswered for an interval, C{missed} counting them in
            a row; the client keeps pinging.
        @param credentials: C{(user, password)} to log in with, for a broker
            that takes passwords.
        @raise ValueError: the user name is not one a broker can have.
        """
        ClientBase.__init__(self)
        self._login = {} if credentials is None else loginOptions(credentials)
        self.clock = clock
        self.brokerAddress = brokerAddress
        self.clientId = clientId if clientId is not None else secrets.token_hex(16)
        self.onPongMissed = onPongMissed
        self.token = None
        self.sessionKey = None
        self.pingInterval = None
        self.maxPayload = datagram.MAX_PAYLOAD
        # Request id -> the DelayedCall that sends it again.
        self._resends = {}
        # Requests sent and unanswered (their ids as numbers, oldest first),
        # and those waiting for room in the window: request id -> frame.
        self._inFlight = OrderedDict()
        self._waiting = OrderedDict()
        # The HELLO waiting for its answer, while saying hello.
        self._helloId = None
        self._rehello = None
        self._pinger = None
        self._awaitingPong = False
        self._missedPongs = 0
        # Ping intervals so far: when skipped messages are given up on.
        self._ticks = 0
        self._stopped = False
        self._forgetShutdownTrigger = None

    # Saying hello

    def handshake(self):
        """
        Start a session with the broker.

        @return: a Deferred that fires with this client once the session is
            in place, and fails with the reason if it cannot be.
        """
        return Deferred.fromCoroutine(self._handshake()).addCallback(self._started)

    async def _handshake(self):
        """
        Say HELLO, then HELLO again with the token the broker answered, until
        the broker accepts the token (it refuses one minted for an address
        the client no longer has).

        @return: the options of the broker's last answer.
        """
        while True:
            answer = await self._hello({})
            token = answer.get("token")
            if not token:
                raise ClientProtocolError("the broker's answer to HELLO has no token")
            try:
                answer = await self._hello({"token": token, **self._login, **self._resumeKey()})
            except ServerError as error:
                if error.code != BAD_TOKEN:
                    raise
                continue
            try:
                self.pingInterval = float(answer["ping"])
                self.maxPayload = int(answer["max-payload"])
            except (KeyError, ValueError):
                raise ClientProtocolError(f"unexpected answer to HELLO: {answer}") from None
            if answer.get("session") not in ("new", "resumed"):
                raise ClientProtocolError(f"unexpected answer to HELLO: {answer}")
            self.token = token
            self.sessionKey = answer.get("key", self.sessionKey)
            self.user = answer.get("user")
            return answer

    def _resumeKey(self):
        """
        The option that proves this client holds its session, once it has
        one.
        """
        return {} if self.sessionKey is None else {"key": self.sessionKey}

    def _hello(self, options):
        requestId = self._helloId = self._nextId()
        frame = wire.encodeHello(requestId, self.clientId, options)
        if "token" not in options and len(frame) < HELLO_SIZE:
            padding = HELLO_SIZE - len(frame) - len(b" pad=")
            frame = wire.encodeHello(
                requestId, self.clientId, {**options, "pad": "x" * max(padding, 1)}
            )
        return self._sendRequest(requestId, frame, self._write)

    def _started(self, answer):
        self.connected = True
        self._pinger = LoopingCall(self._pingTick)
        self._pinger.clock = self.clock
        # A LoopingCall whose function raises stops for good: say so loudly.
        self._pinger.start(self.pingInterval, now=False).addErrback(
            lambda failure: self._log.failure("pinging stopped", failure)
        )
        return self

    def _sayHelloAgain(self):
        """
        The broker refused our token: the client's address changed, or the
        broker restarted.  Get a token for the address we have now, and
        resume the session (or find that it is gone).
        """
        if self._rehello is not None:
            return
        # Nothing else is sent until the new token arrives.
        self.token = None
        self._rehello = Deferred.fromCoroutine(self._handshake())
        self._rehello.addCallbacks(self._resumed, self._sessionLost)

    def _resumed(self, answer):
        self._rehello = None
        if answer["session"] != "resumed":
            self._sessionLost()
            return
        for resend in self._resends.values():
            resend.reset(0)

    def _sessionLost(self, reason=None):
        self._rehello = None
        if not self.connected:
            return
        why = "its session expired, or the broker restarted"
        if reason is not None:
            why = f"{why} ({reason.getErrorMessage()})"
        self._stop(Failure(SessionLost(why)))

    # Sending

    def _write(self, data):
        try:
            self.transport.write(data, self.brokerAddress)
        except (OSError, MessageLengthError) as error:
            # Lost, as the network could have lost it: requests are resent.
            self._log.warn("could not send a datagram: {error}", error=error)

    def _sendFrame(self, frame):
        if self.token is not None:
            self._write(datagram.withIdentity(frame, self.clientId, self.token))

    def _sendRequest(self, requestId, frame, send=None):
        """
        Send a request, and send it again until it is answered.  A request
        of the session waits while the window is full (L{REQUEST_WINDOW});
        a HELLO (C{send} given) goes at once.
        """
        deferred = self._pending.add(requestId, self._takePending)
        if send is not None:
            self._resend(requestId, frame, send, RETRY_FIRST_DELAY)
        else:
            self._waiting[requestId] = frame
            self._sendWaiting()
        return deferred

    def _sendWaiting(self):
        """
        Send the requests waiting, oldest first, as far as the window allows.
        """
        while self._waiting:
            requestId, frame = next(iter(self._waiting.items()))
            number = int(requestId)
            if self._inFlight:
                oldest = next(iter(self._inFlight.values()))
                if len(self._inFlight) >= REQUEST_WINDOW or number - oldest >= REQUEST_WINDOW:
                    return
            del self._waiting[requestId]
            self._inFlight[requestId] = number
            self._resend(requestId, frame, self._sendFrame, RETRY_FIRST_DELAY)

    def _resend(self, requestId, frame, send, delay):
        send(frame)
        if requestId in self._pending:
            self._resends[requestId] = self.clock.callLater(
                delay, self._resend, requestId, frame, send, min(2 * delay, RETRY_MAX_DELAY)
            )

    def _takePending(self, requestId):
        resend = self._resends.pop(requestId, None)
        if resend is not None and resend.active():
            resend.cancel()
        self._waiting.pop(requestId, None)
        if self._inFlight.pop(requestId, None) is not None:
            self._sendWaiting()
        return ClientBase._takePending(self, requestId)

    def publish(self, topic, payload, retain=False, options=None):
        """
        Publish C{payload} (bytes) on C{topic}, and with C{retain} keep it as
        the topic's retained message (see L{ClientBase.publish}).

        @return: a Deferred that fires with C{None} on the broker's PubAck.
        @raise ValueError: the message does not fit in a datagram.
        """
        if len(payload) > self.maxPayload:
            raise ValueError(
                f"a payload of {len(payload)} bytes is larger than the "
                f"{self.maxPayload} bytes the broker accepts over UDP"
            )
        if len(topic.encode("utf-8")) > MAX_TOPIC_LENGTH:
            raise ValueError(f"topic is longer than {MAX_TOPIC_LENGTH} bytes")
        return ClientBase.publish(self, topic, payload, retain, options)

    # Health

    def _skipped(self, subscription, first, end):
        # A datagram lost on the way is resent, and may arrive later than
        # the ones after it: give it a whole ping interval, reporting it at
        # the second ping from now.
        subscription.skipped(first, end, self._ticks + 2)

    def _reportGaps(self):
        for subscription in self._subscriptions.values():
            given = [
                seq
                for seq, reportAt in subscription.missing.items()
                if reportAt is not None and reportAt <= self._ticks
            ]
            for seq in given:
                subscription.missing[seq] = None
            if given and subscription.onGap is not None:
                subscription.onGap(subscription.topic, len(given))

    def _pingTick(self):
        self._ticks += 1
        self._reportGaps()
        if self._awaitingPong:
            self._missedPongs += 1
            if self.onPongMissed is not None:
                self.onPongMissed(self._missedPongs)
        self._awaitingPong = True
        self._sendFrame(wire.PING_FRAME)

    def _handlePong(self, pong):
        self._awaitingPong = False
        self._missedPongs = 0
        ClientBase._handlePong(self, pong)

    # Closing

    def closeWithReactor(self, reactor):
        """
        Close when the reactor stops (as it closes TCP connections then), so
        that the broker forgets this client at once instead of expiring it.
        """
        trigger = reactor.addSystemEventTrigger("before", "shutdown", self._reactorStopping)
        self._forgetShutdownTrigger = lambda: reactor.removeSystemEventTrigger(trigger)

    def _reactorStopping(self):
        # The trigger is running: removing it now would be an error.
        self._forgetShutdownTrigger = None
        return self.close()

    def close(self):
        """
        Say BYE (once: if it is lost, the broker expires the session) and
        stop.

        @return: a Deferred that fires once the client is closed.
        """
        closed = self.whenDisconnected()
        if self.connected:
            self._sendFrame(wire.BYE_FRAME)
            self._stop(Failure(ConnectionDone("closed by the client")))
        return closed

    def _stop(self, reason):
        """
        Stop sending, fail what waits, and close the socket.
        """
        if self._stopped:
            return
        self._stopped = True
        self.token = None
        if self._forgetShutdownTrigger is not None:
            self._forgetShutdownTrigger()
            self._forgetShutdownTrigger = None
        self._lost(reason)
        if self._pinger is not None and self._pinger.running:
            self._pinger.stop()
        resends, self._resends = self._resends, {}
        for resend in resends.values():
            if resend.active():
                resend.cancel()
        self._waiting.clear()
        self._inFlight.clear()
        if self._rehello is not None:
            self._rehello.cancel()
        if self.transport is not None:
            self.transport.stopListening()

    # Datagrams from the broker

    def datagramReceived(self, data, address):
        # A datagram read after close() would reach a handler told the
        # client is closed.
        if address != self.brokerAddress or self._stopped:
            return
        try:
            line, rest = datagram.splitDatagram(data)
            reply = wire.parseReply(line)
            if reply is None:
                return
            if type(reply) in (wire.MessageHeader, wire.DataHeader):
                self._payloadReceived(reply, datagram.payloadOf(rest, reply.size))
            else:
                datagram.checkNothingAfter(rest)
                self._replyReceived(reply)
        except RequestError as error:
            # Nothing to fall out of step with: drop it.
            self._log.warn(
                "dropping a datagram the broker should not have sent: {reason}",
                reason=error.reason,
            )

    def _handleError(self, error):
        if error.code == BAD_TOKEN and error.id != self._helloId:
            # The request waits, and is resent once the session is resumed.
            self._sayHelloAgain()
        elif error.code == NO_SESSION:
            self._sessionLost()
        elif error.code == BUSY and error.id in self._pending:
            # Nothing was published: the request's resends go on until one
            # is taken.
            pass
        else:
            ClientBase._handleError(self, error)

    _replyHandlers = {
        **ClientBase._replyHandlers,
        wire.Error: _handleError,
        wire.Pong: _handlePong,
    }


def connectUDP(reactor, host, port, clientId=None, onPongMissed=None, credentials=None):
    """
    Start a session with a broker over UDP.

    @param host: the broker's host name or IP address.
    @param clientId: see L{DallalDatagramClient}; random by default.
    @param onPongMissed: see L{DallalDatagramClient}.
    @param credentials: C{(user, password)}, for a broker that takes
        passwords.
    @return: a Deferred firing with a L{DallalDatagramClient} once the
        broker has accepted it (and its login); cancel it to give up.
    """
    return Deferred.fromCoroutine(
        _connectUDP(reactor, host, port, clientId, onPongMissed, credentials)
    )


async def _connectUDP(reactor, host, port, clientId, onPongMissed, credentials):
    ip = host if isIPAddress(host) or isIPv6Address(host) else await reactor.resolve(host)
    client = DallalDatagramClient(reactor, (ip, port), clientId, onPongMissed, credentials)
    reactor.listenUDP(
        0,
        client,
        interface="::" if isIPv6Address(ip) else "",
        maxPacketSize=datagram.MAX_PACKET_SIZE,
    )
    try:
        await client.handshake()
    except BaseException:
        client._stop(Failure())
        raise
    client.closeWithReactor(reactor)
    return client
