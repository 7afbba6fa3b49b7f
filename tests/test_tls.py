"""
TLS through Twisted's endpoints: a broker listening on C{--tcp ssl:...},
the C{dallal --tls [--cafile CA]} command, and the client library over a
C{tls:} endpoint description or L{dallal.client.tlsEndpoint}.

The test makes its own CA and server certificates; the broker's
certificate names C{localhost} and C{127.0.0.1}.  It needs Twisted's TLS
extra (C{pip install 'twisted[tls]'}: pyOpenSSL, service_identity and
cryptography).
"""

import datetime
import ipaddress
import re
import socket
import ssl
import time

import pytest
import pytest_twisted
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from helpers import DALLAL, TWISTD, BrokerProcess, OutputCollector, dallal
from OpenSSL.SSL import Error as TLSError
from twisted.internet import reactor
from twisted.internet.defer import Deferred
from twisted.internet.threads import deferToThread

from dallal.client import connect, tlsEndpoint

PUBLISHED = b"your message published successfully\n"
PUBLISH_FAILED = b"your message publishing failed\n"
WAIT = 30


# A small PKI


def _name(commonName):
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, commonName)])


def _builder(subject, issuer, publicKey):
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(publicKey)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def makeCA(commonName):
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = (
        _builder(_name(commonName), _name(commonName), key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return certificate, key


def makeServerCertificate(ca, caKey, names):
    """
    A server certificate signed by C{ca} for C{names}: DNS names, or IP
    addresses as text.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    alternatives = []
    for name in names:
        try:
            alternatives.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternatives.append(x509.DNSName(name))
    certificate = (
        _builder(_name(names[0]), ca.subject, key.public_key())
        .add_extension(x509.SubjectAlternativeName(alternatives), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(caKey.public_key()), critical=False
        )
        .sign(caKey, hashes.SHA256())
    )
    return certificate, key


def writeCertificate(path, certificate):
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return path


def writeKey(path, key):
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


class PKI:
    """
    The files of a test PKI: C{ca} (which signed the broker's certificates),
    C{otherCA} (which did not), C{caDirectory} (C{ca} alone in a folder, for
    Twisted's C{trustRoots=}), and the broker's key and certificates: one
    for C{localhost} and C{127.0.0.1}, one for C{elsewhere.example} only.
    """

    def __init__(self, folder):
        ca, caKey = makeCA("Dallal test CA")
        otherCA, _ = makeCA("Some other CA")
        self.ca = writeCertificate(folder / "ca.pem", ca)
        self.otherCA = writeCertificate(folder / "other-ca.pem", otherCA)
        self.caDirectory = folder / "trusted"
        self.caDirectory.mkdir()
        writeCertificate(self.caDirectory / "ca.pem", ca)
        certificate, key = makeServerCertificate(ca, caKey, ["localhost", "127.0.0.1"])
        self.certificate = writeCertificate(folder / "broker.pem", certificate)
        self.key = writeKey(folder / "broker-key.pem", key)
        certificate, key = makeServerCertificate(ca, caKey, ["elsewhere.example"])
        self.elsewhereCertificate = writeCertificate(folder / "elsewhere.pem", certificate)
        self.elsewhereKey = writeKey(folder / "elsewhere-key.pem", key)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return PKI(tmp_path_factory.mktemp("pki"))


def startTlsBroker(folder, key, certificate, *options):
    """
    C{twistd dallal} listening on TLS only, on an ephemeral loopback port
    (its C{listening} event gives the port).
    """
    return BrokerProcess(
        [
            TWISTD, "-n", "--pidfile=", "dallal",
            "--tcp", f"ssl:0:interface=127.0.0.1:privateKey={key}:certKey={certificate}",
            *options,
        ],
        folder,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tlsBroker(pki, tmp_path_factory):
    process = startTlsBroker(tmp_path_factory.mktemp("broker"), pki.key, pki.certificate)
    try:
        yield process
    finally:
        process.stop()


def tlsCommand(ca, host, port, *arguments):
    return dallal("--tls", "--cafile", ca, host, port, *arguments)


# The command line


@pytest.mark.e2e
def test_publishAndSubscribeOverTls(pki, tlsBroker):
    """
    C{dallal --tls --cafile CA} publishes and subscribes through the
    broker's TLS port with the usual output lines, checking the host name
    (C{localhost}) or the address (C{127.0.0.1}) against the certificate.
    """
    listener = OutputCollector(
        [DALLAL, "--tls", "--cafile", pki.ca, "localhost", tlsBroker.port, "subscribe", "news"],
        None,
    )
    try:
        listener.waitFor(re.escape(b"subscribing on news\n"), WAIT)
        result = tlsCommand(
            pki.ca, "127.0.0.1", tlsBroker.port, "publish", "news", "hello over tls"
        )
        assert (result.stdout, result.stderr, result.returncode) == (PUBLISHED, b"", 0)
        listener.waitFor(re.escape(b"news: hello over tls\n"), WAIT)
        assert listener.terminate() == 0
    finally:
        listener.kill()
    assert listener.output == b"subscribing on news\nnews: hello over tls\n"


@pytest.mark.e2e
def test_wrongCaFails(pki, tlsBroker):
    """
    A broker certificate not signed by the CA given is refused: the
    specification's failure lines, and the reason on standard error.
    """
    result = tlsCommand(pki.otherCA, "127.0.0.1", tlsBroker.port, "publish", "news", "x")
    assert result.returncode == 1
    assert result.stdout == PUBLISH_FAILED
    assert result.stderr == (
        b"dallal: TLS with the broker at 127.0.0.1:%d failed: certificate verify failed "
        b"(the broker's certificate is not signed by a trusted CA: see --cafile)\n" % tlsBroker.port
    )
    result = tlsCommand(pki.otherCA, "127.0.0.1", tlsBroker.port, "subscribe", "news")
    assert (result.stdout, result.returncode) == (b"subscribing failed\n", 1)
    assert b"certificate verify failed" in result.stderr


@pytest.mark.e2e
def test_plainClientOnATlsPort(tlsBroker):
    """
    Without C{--tls}, a TLS port closes the connection without a word:
    the client says it is probably a TLS port.
    """
    result = dallal("127.0.0.1", tlsBroker.port, "publish", "news", "x")
    assert (result.stdout, result.returncode) == (PUBLISH_FAILED, 1)
    assert result.stderr == (
        b"dallal: the broker at 127.0.0.1:%d closed the connection before answering: "
        b"probably a TLS port (add --tls)\n" % tlsBroker.port
    )


@pytest.mark.e2e
def test_tlsClientOnAPlainPort(pki, broker):
    result = tlsCommand(pki.ca, "127.0.0.1", broker.port, "publish", "news", "x")
    assert (result.stdout, result.returncode) == (PUBLISH_FAILED, 1)
    assert re.fullmatch(
        rb"dallal: TLS with the broker at 127\.0\.0\.1:%d failed: .+ "
        rb"\(probably a plain TCP port, not TLS: try without --tls\)\n" % broker.port,
        result.stderr,
    ), result.stderr


@pytest.mark.e2e
def test_systemRootsDoNotTrustTheTestCa(tlsBroker):
    """
    Without C{--cafile} the system's roots are used, and they do not trust
    a CA made by this test.
    """
    result = dallal("--tls", "127.0.0.1", tlsBroker.port, "publish", "news", "x")
    assert (result.stdout, result.returncode) == (PUBLISH_FAILED, 1)
    assert b"certificate verify failed" in result.stderr


@pytest.mark.e2e
def test_hostNameIsChecked(pki, tmp_path):
    """
    A certificate from the right CA but for another name is refused, for an
    address as for a host name.
    """
    broker = startTlsBroker(tmp_path, pki.elsewhereKey, pki.elsewhereCertificate)
    try:
        for host in ("127.0.0.1", "localhost"):
            result = tlsCommand(pki.ca, host, broker.port, "publish", "news", "x")
            assert (result.stdout, result.returncode) == (PUBLISH_FAILED, 1)
            assert result.stderr == (
                b"dallal: TLS with the broker at %s:%d failed: the broker's certificate is "
                b"not for %s (its subjectAltName does not name it)\n"
                % (host.encode(), broker.port, host.encode())
            )
    finally:
        broker.stop()


@pytest.mark.e2e
@pytest.mark.parametrize(
    "arguments, status, stdout, stderr",
    [
        (
            ["--tls", "--cafile", "/nonexistent/ca.pem", "127.0.0.1", "1", "publish", "t", "m"],
            1,
            PUBLISH_FAILED,
            b"dallal: cannot read the CA file /nonexistent/ca.pem: No such file or directory\n",
        ),
        (["--cafile", "ca.pem", "127.0.0.1", "1", "publish", "t", "m"], 2, b"", b"--cafile goes with --tls"),
        (["--tls", "--udp", "127.0.0.1", "1", "publish", "t", "m"], 2, b"", b"not allowed with argument"),
    ],
)  # fmt: skip
def test_badTlsOptions(arguments, status, stdout, stderr):
    result = dallal(*arguments)
    assert (result.returncode, result.stdout) == (status, stdout)
    assert stderr in result.stderr


@pytest.mark.e2e
def test_caFileWithoutCertificate(tmp_path):
    notPem = tmp_path / "ca.pem"
    notPem.write_text("not a certificate\n")
    result = dallal("--tls", "--cafile", notPem, "127.0.0.1", "1", "publish", "t", "m")
    assert (result.returncode, result.stdout) == (1, PUBLISH_FAILED)
    assert result.stderr == b"dallal: the CA file %s holds no PEM certificate\n" % bytes(notPem)


# Closing over TLS: Twisted's TLS transport does not close while a producer
# is registered, and the broker registers one for each connection
# (dallal.server.streams' output valve), which it must unregister first.


def rawTls(pki, port):
    context = ssl.create_default_context(cafile=str(pki.ca))
    raw = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    return context.wrap_socket(raw, server_hostname="localhost")


def readUntilClosed(connection, timeout=10):
    """
    Everything the broker sends until it closes the connection.

    @raise AssertionError: it did not close it within C{timeout} seconds.
    """
    received = b""
    deadline = time.monotonic() + timeout
    connection.settimeout(0.5)
    while time.monotonic() < deadline:
        try:
            chunk = connection.recv(65536)
        except TimeoutError:
            continue
        except (ssl.SSLError, ConnectionError):
            return received
        if not chunk:
            return received
        received += chunk
    raise AssertionError(f"still open after {timeout} s; received {received!r}")


@pytest.mark.e2e
@pytest.mark.parametrize(
    "sent, answer",
    [
        (b"L" * 5000 + b"\r\n", b"ERR - LINE_TOO_LONG control line longer than 4096 bytes\r\n"),
        (
            b"PUB 1 news 2\r\nhello\r\n",
            b"ERR 1 BAD_FRAMING payload not followed by a line end: its size was wrong\r\n",
        ),
        (b"BYE\r\n", b"BYE\r\n"),
    ],
    ids=["line too long", "bad framing", "bye"],
)
def test_brokerClosesTlsConnections(pki, tlsBroker, sent, answer):
    """
    After a fatal error, or a client's BYE, the broker closes a TLS
    connection as it does a TCP one: the answer, then the end.
    """
    with rawTls(pki, tlsBroker.port) as connection:
        connection.sendall(sent)
        assert readUntilClosed(connection) == answer


@pytest.mark.e2e
def test_connectionOverTheLimitIsToldWhyOverTls(pki, tmp_path):
    """
    TLS has no half-close: a connection over --max-connections gets its
    ERR once the handshake is done, then the broker closes it.
    """
    broker = startTlsBroker(tmp_path, pki.key, pki.certificate, "--max-connections", "1")
    try:
        with rawTls(pki, broker.port) as admitted:
            admitted.sendall(b"PING\r\n")
            assert admitted.recv(100) == b"PONG\r\n"
            with rawTls(pki, broker.port) as refused:
                assert readUntilClosed(refused) == (
                    b"ERR - TOO_MANY_CLIENTS the broker has its maximum of 1 connections: "
                    b"try again later\r\n"
                )
    finally:
        broker.stop()


# The client library


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["tlsEndpoint", "description"])
@pytest_twisted.ensureDeferred
async def test_clientLibraryOverTls(pki, tlsBroker, how):
    """
    L{dallal.client.connect} over L{tlsEndpoint} (a CA file), or over
    Twisted's C{tls:} endpoint description (a folder of CA files): a message
    published over TLS reaches a subscriber over TLS.
    """
    if how == "tlsEndpoint":

        def endpoint():
            return tlsEndpoint(reactor, "127.0.0.1", tlsBroker.port, str(pki.ca))

    else:

        def endpoint():
            return f"tls:host=127.0.0.1:port={tlsBroker.port}:trustRoots={pki.caDirectory}"

    subscriber = await connect(reactor, endpoint()).addTimeout(WAIT, reactor)
    publisher = await connect(reactor, endpoint()).addTimeout(WAIT, reactor)
    try:
        arrived = Deferred()
        await subscriber.subscribe(["lib"], arrived.callback).addTimeout(WAIT, reactor)
        await publisher.publish("lib", b"over tls").addTimeout(WAIT, reactor)
        message = await arrived.addTimeout(WAIT, reactor)
        assert (message.topic, message.payload) == ("lib", b"over tls")
        # A graceful BYE ends in the connection closing.
        await publisher.bye().addTimeout(WAIT, reactor)
    finally:
        await subscriber.close().addTimeout(WAIT, reactor)
        await publisher.close().addTimeout(WAIT, reactor)


@pytest.mark.e2e
@pytest_twisted.ensureDeferred
async def test_clientLibraryRefusesAnUntrustedBroker(pki, tlsBroker):
    """
    With a CA that did not sign the broker's certificate, the client's
    requests fail with the TLS error, and it is disconnected.
    """
    client = await connect(
        reactor, tlsEndpoint(reactor, "127.0.0.1", tlsBroker.port, str(pki.otherCA))
    ).addTimeout(WAIT, reactor)
    with pytest.raises(TLSError, match="certificate verify failed"):
        await client.publish("news", b"x").addTimeout(WAIT, reactor)
    await client.whenDisconnected().addTimeout(WAIT, reactor)


def test_tlsEndpointRefusesAFileWithoutCertificates(tmp_path):
    empty = tmp_path / "empty.pem"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="holds no PEM certificate"):
        tlsEndpoint(reactor, "127.0.0.1", 1, str(empty))


@pytest.mark.e2e
@pytest_twisted.ensureDeferred
async def test_brokerStopClosesTlsClients(pki, tmp_path):
    """
    A broker stopping with TLS clients connected closes their connections
    and shuts down cleanly.
    """
    broker = startTlsBroker(tmp_path, pki.key, pki.certificate)
    try:
        client = await connect(
            reactor, tlsEndpoint(reactor, "127.0.0.1", broker.port, str(pki.ca))
        ).addTimeout(WAIT, reactor)
        await client.subscribe(["x"], lambda message: None).addTimeout(WAIT, reactor)
        closed = client.whenDisconnected()
        await deferToThread(broker.stop)
        await closed.addTimeout(WAIT, reactor)
    finally:
        broker.kill()
