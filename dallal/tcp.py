"""
The broker over TCP: one L{BrokerProtocol} per connection.

The protocol parses and frames; the L{Broker} core decides.  It never writes
to a connection that is closed or closing, and answers every bad request
with an C{ERR} frame; PROTOCOL.md says which errors also close it.  What a
request does is the same as over UDP: L{RequestHandler}.
"""

from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import ServerFactory
from zope.interface import implementer

from dallal import __version__, wire
from dallal.errors import BAD_FRAMING, LINE_TOO_LONG, NO_ID, RequestError
from dallal.framing import FrameReceiver
from dallal.interfaces import ISubscriber
from dallal.keepalive import IPingable
from dallal.session import RequestHandler


def formatAddress(address):
    """
    C{host:port} for an IPv4 address, C{[host]:port} for IPv6, the type name
    for anything else (a UNIX socket has no port to report).
    """
    host = getattr(address, "host", None)
    port = getattr(address, "port", None)
    if host is None or port is None:
        return type(address).__name__
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


@implementer(IPushProducer)
class _DeliveryValve:
    """
    Registered with the transport so that the broker stops writing to a
    client whose write buffer is full, and holds what waits in its own
    bounded queues instead (L{dallal.delivery.Outbox}).

    The protocol itself cannot be the producer: as a L{LineReceiver} its
    C{pauseProducing} pauses I{reading} from the client.
    """

    def __init__(self, protocol):
        self.protocol = protocol

    def pauseProducing(self):
        if self.protocol._attached:
            self.protocol.broker.pauseDelivery(self.protocol)

    def resumeProducing(self):
        if self.protocol._attached:
            self.protocol.broker.resumeDelivery(self.protocol)

    def stopProducing(self):
        # The connection is closing; connectionLost detaches the session.
        pass


@implementer(ISubscriber, IPingable)
class BrokerProtocol(FrameReceiver, RequestHandler):
    """
    One TCP client of the broker.
    """

    transportName = "tcp"
    peer = "?"

    def __init__(self, broker, sweep):
        self.broker = broker
        self.sweep = sweep
        self.MAX_LENGTH = broker.config.maxControlLine
        self._attached = False
        self._publishing = None
        self._closeReason = "closed"

    def connectionMade(self):
        self.peer = formatAddress(self.transport.getPeer())
        self._attached = True
        self.broker.attach(self)
        self.sweep.add(self)
        self.transport.registerProducer(_DeliveryValve(self), True)

    def connectionLost(self, reason):
        if self._attached:
            self._attached = False
            self.sweep.remove(self)
            self.broker.detach(self, self._closeReason)

    # RequestHandler

    def sendFrame(self, *chunks):
        if self._attached and not self.transport.disconnecting:
            self.transport.writeSequence(chunks)

    def refuse(self, error, fatal=False):
        RequestHandler.refuse(self, error, fatal)
        if fatal:
            self._closeReason = "protocol_error"
            self._close()

    def pongReceived(self):
        self.sweep.pongReceived(self)

    def _close(self):
        """
        Close the connection once what was written is sent.

        The delivery valve is unregistered first: over TLS
        (L{twisted.protocols.tls}) a connection with a producer registered
        does not close until the producer is unregistered, so the client
        would stay connected after the broker's fatal ERR or BYE.
        """
        if not self.transport.disconnecting:
            self.transport.unregisterProducer()
            self.transport.loseConnection()

    # Incoming frames

    def lineReceived(self, line):
        if not self._attached:
            # Detached by the broker's shutdown while the connection drains:
            # there is no session left to act for.
            return
        try:
            request = wire.parseRequest(line)
        except RequestError as error:
            self.refuse(error)
            return
        if request is None:
            return
        kind = type(request)
        if kind is wire.Publish:
            self._publishReceived(request)
        elif kind is wire.Hello:
            self._helloReceived(request)
        elif kind is wire.Bye:
            self._byeReceived()
        else:
            self.handleRequest(request)

    def _helloReceived(self, hello):
        """
        The optional hello over TCP: tell the client the broker's limits.
        """
        config = self.broker.config
        self.sendFrame(
            wire.encodeHelloReply(
                hello.id,
                {
                    "version": __version__,
                    "ping": f"{self.sweep.interval:g}",
                    "max-payload": str(config.maxPayload),
                    "max-topic": str(config.maxTopicLength),
                },
            )
        )

    def _byeReceived(self):
        """
        A graceful disconnect: answer BYE, then close once it is written.
        """
        self.sendFrame(wire.BYE_FRAME)
        self._close()

    def _publishReceived(self, request):
        try:
            self.broker.checkPayloadSize(request.size, request.id)
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
        self.publish(request, payload)

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
        self.refuse(
            RequestError(
                LINE_TOO_LONG,
                f"control line longer than {self.MAX_LENGTH} bytes",
            ),
            fatal=True,
        )

    # ISubscriber

    def sendMessage(self, message, subscriptionId, seq, deliveryId, redelivered):
        if self._attached and not self.transport.disconnecting:
            self.transport.writeSequence(
                wire.encodeMessage(message, subscriptionId, seq, deliveryId, redelivered)
            )

    def disconnect(self, reason):
        self._closeReason = reason
        if reason == "shutdown":
            # The broker has already detached this session.
            self._attached = False
            self.sweep.remove(self)
            self._close()
        else:
            # A slow consumer's buffer may never drain: don't wait for it.
            self.transport.abortConnection()

    # IPingable

    def sendPing(self):
        self.sendFrame(wire.PING_FRAME)

    def pingMissed(self, missed):
        self.broker.pingMissed(self, missed)

    def keepaliveExpired(self, missed):
        self.broker.clientDropped(self, missed)
        self._closeReason = "missed_pings"
        # The peer is not answering, so it may not be reading either: do not
        # wait for the write buffer to drain.
        self.transport.abortConnection()


class BrokerFactory(ServerFactory):
    """
    Builds a L{BrokerProtocol} for each connection to one broker.
    """

    # The broker logs its own listening event; Twisted's would be noise.
    noisy = False

    def __init__(self, broker, sweep):
        self.broker = broker
        self.sweep = sweep

    def buildProtocol(self, addr):
        protocol = BrokerProtocol(self.broker, self.sweep)
        protocol.factory = self
        return protocol
