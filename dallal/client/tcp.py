"""
A client of a broker over TCP (or TLS): one L{DallalClientProtocol} per
connection.
"""

import re
import secrets

from twisted.internet.defer import maybeDeferred
from twisted.internet.endpoints import clientFromString, connectProtocol
from twisted.internet.error import ConnectionDone
from twisted.python.failure import Failure

from dallal.client.base import ClientBase, checkToken, loginOptions
from dallal.client.errors import ClosedUnanswered, ServerError
from dallal.errors import CLOSING, RequestError
from dallal.protocol import wire
from dallal.protocol.framing import FrameReceiver


class DallalClientProtocol(FrameReceiver, ClientBase):
    """
    One TCP connection to a broker.
    """

    def __init__(self):
        ClientBase.__init__(self)
        self._receiving = None
        # The error the broker closes the connection for, once it sent one.
        self._closedFor = None
        self._heardFrom = False

    def connectionMade(self):
        self.connected = True

    def connectionLost(self, reason):
        if self._closedFor is not None:
            # What waits for an answer fails with why, not just "closed".
            reason = Failure(self._closedFor)
        elif not self._heardFrom and type(reason.value) is ConnectionDone:
            reason = Failure(ClosedUnanswered())
        self._lost(reason)

    def _sendFrame(self, frame):
        if self.connected and not self.transport.disconnecting:
            if isinstance(frame, bytes):
                self.transport.write(frame)
            else:
                self.transport.writeSequence(frame)

    def close(self):
        """
        Close the connection.

        @return: a Deferred that fires once it is closed.
        """
        closed = self.whenDisconnected()
        if self.connected:
            self.transport.loseConnection()
        return closed

    def hello(self, clientId, **options):
        """
        The optional hello over TCP: introduce this client (C{name=},
        C{version=} options, as text).

        @return: a Deferred that fires with the broker's answer, a dict of
            its limits (C{max-payload}, C{max-topic}, C{max-levels},
            C{max-subscriptions}, C{max-line}), C{ping} and C{version}.
        """
        checkToken(clientId, "client id")
        requestId = self._nextId()
        return self._request(wire.encodeHello(requestId, clientId, options), requestId)

    def login(self, credentials, clientId=None):
        """
        Log in to a broker that takes passwords: a HELLO with the user name
        and password.

        @param credentials: C{(user, password)}, the password as text or
            bytes.
        @param clientId: who this client is to the broker's ACL (C{%c});
            random by default.
        @return: a Deferred that fires with the broker's answer (as
            L{hello}'s, with C{user}), or fails with L{ServerError}
            C{BAD_CREDENTIALS}, after which the broker closes the
            connection.
        @raise ValueError: the user name is not one a broker can have.
        """
        options = loginOptions(credentials)
        return self.hello(clientId or secrets.token_hex(16), **options).addCallback(self._loggedIn)

    def _loggedIn(self, answer):
        self.user = answer.get("user")
        return answer

    def bye(self):
        """
        Disconnect gracefully: say BYE, and the broker answers BYE and
        closes the connection.

        @return: a Deferred that fires once it is closed.
        """
        closed = self.whenDisconnected()
        self._sendFrame(wire.BYE_FRAME)
        return closed

    def lineReceived(self, line):
        self._heardFrom = True
        try:
            reply = wire.parseReply(line)
        except RequestError as error:
            self._log.error(
                "closing: unexpected frame from the broker: {reason}", reason=error.reason
            )
            self.transport.loseConnection()
            return
        if reply is None:
            return
        if type(reply) in (wire.MessageHeader, wire.DataHeader):
            self._receiving = reply
            self.expectPayload(reply.size)
        else:
            self._replyReceived(reply)

    def payloadReceived(self, payload):
        header, self._receiving = self._receiving, None
        self._payloadReceived(header, payload)

    def _handleError(self, error):
        if error.code in CLOSING:
            self._closedFor = ServerError(error.code, error.reason)
        ClientBase._handleError(self, error)

    _replyHandlers = {**ClientBase._replyHandlers, wire.Error: _handleError}


def connect(reactor, endpoint, credentials=None, clientId=None):
    """
    Connect to a broker, and log in if given credentials.

    @param endpoint: an C{IStreamClientEndpoint}, or a client endpoint
        description such as C{"tcp:127.0.0.1:1373"}.
    @param credentials: C{(user, password)}, for a broker that takes
        passwords (see L{DallalClientProtocol.login}).
    @param clientId: the client id of the login; random by default.
    @return: a Deferred firing with a connected (and logged in)
        L{DallalClientProtocol}; if the login fails, it fails with the
        broker's L{ServerError} and the connection is closed.
    """
    if isinstance(endpoint, str):
        endpoint = clientFromString(reactor, endpoint)
    connecting = connectProtocol(endpoint, DallalClientProtocol())
    if credentials is None:
        return connecting
    return connecting.addCallback(_logIn, credentials, clientId)


def _logIn(client, credentials, clientId):
    def failed(failure):
        client.close()
        return failure

    return maybeDeferred(client.login, credentials, clientId).addCallbacks(
        lambda answer: client, failed
    )


_PEM_CERTIFICATE = re.compile(
    rb"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL
)


def tlsEndpoint(reactor, host, port, cafile=None):
    """
    An endpoint to a broker over TLS (its C{--tcp ssl:...} listener), for
    L{connect}: the broker's certificate must be signed by a CA of
    C{cafile}, or of the system's roots, and be for C{host} (a DNS name, or
    an IP address in the certificate's subjectAltName).

    Twisted's C{tls:host=...:port=...:trustRoots=DIRECTORY} endpoint
    description does the same with a directory of C{.pem} files.

    @param cafile: the path of a PEM file of one or more CA certificates.
    @raise ValueError: C{cafile} cannot be read or holds no certificate.
    @raise ImportError: pyOpenSSL is missing (C{pip install twisted[tls]}).
    """
    from twisted.internet.endpoints import HostnameEndpoint, wrapClientTLS
    from twisted.internet.ssl import Certificate, optionsForClientTLS, trustRootFromCertificates

    trustRoot = None
    if cafile is not None:
        try:
            with open(cafile, "rb") as file:
                blocks = _PEM_CERTIFICATE.findall(file.read())
            certificates = [Certificate.loadPEM(block) for block in blocks]
        except OSError as error:
            raise ValueError(f"cannot read the CA file {cafile}: {error.strerror}") from error
        except Exception as error:
            raise ValueError(
                f"the CA file {cafile} holds an unreadable certificate: {error}"
            ) from error
        if not certificates:
            raise ValueError(f"the CA file {cafile} holds no PEM certificate")
        trustRoot = trustRootFromCertificates(certificates)
    return wrapClientTLS(
        optionsForClientTLS(host, trustRoot=trustRoot),
        HostnameEndpoint(reactor, host, port),
    )
