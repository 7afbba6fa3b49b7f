"""
A client session's requests, carried out on the broker core and answered.

TCP and UDP frame requests differently (a stream of frames, one frame per
datagram) but carry them out the same way: L{RequestHandler} is that
shared part.  A transport parses a control line with L{dallal.wire},
reads the payload its own way, and hands the request here; the answers go
back through the transport's L{RequestHandler.sendFrame}.
"""

import json

from dallal import wire
from dallal.delivery import LATEST
from dallal.errors import RequestError


class RequestHandler:
    """
    Mixin for a transport's session: carries out its requests.

    The session is the L{ISubscriber} the broker core knows; it provides
    C{broker} (the core), L{sendFrame} and L{pongReceived}.
    """

    broker = None

    def sendFrame(self, *chunks):
        """
        Send one frame, given as byte strings to concatenate, to the client.
        """
        raise NotImplementedError

    def pongReceived(self):
        """
        The client answered the broker's ping.
        """
        raise NotImplementedError

    def handleRequest(self, request):
        """
        Carry out a parsed request other than C{PUB} (whose payload the
        transport reads first, then calls L{publish}).
        """
        self._requestHandlers[type(request)](self, request)

    def refuse(self, error, fatal=False):
        """
        Answer a refused request with C{ERR}, and count it.
        """
        self.sendFrame(wire.encodeError(error.requestId, error.code, error.reason))
        self.broker.protocolError(self, error.code, fatal)

    def publish(self, request, payload):
        try:
            self.broker.publish(self, request.topic, payload, request.id)
        except RequestError as error:
            self.refuse(error)
            return
        self.sendFrame(wire.encodePubAck(request.id))

    def _handleSubscribe(self, request):
        try:
            self.broker.subscribe(
                self, request.topic, request.id, request.options.get("mode", LATEST)
            )
        except RequestError as error:
            self.refuse(error)
            return
        self.sendFrame(wire.encodeSubAck(request.id))

    def _handleAck(self, request):
        self.broker.acknowledge(self, request.deliveryId)

    def _handleStats(self, request):
        payload = json.dumps(self.broker.stats(), sort_keys=True).encode("ascii")
        self.sendFrame(*wire.encodeStats(request.id, payload))

    def _handlePing(self, request):
        self.sendFrame(wire.PONG_FRAME)

    def _handlePong(self, request):
        self.pongReceived()

    _requestHandlers = {
        wire.Subscribe: _handleSubscribe,
        wire.Ack: _handleAck,
        wire.Stats: _handleStats,
        wire.Ping: _handlePing,
        wire.Pong: _handlePong,
    }
