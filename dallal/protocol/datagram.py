"""
Frames over UDP: one frame per datagram.

A datagram holds exactly one frame of the TCP wire format (PROTOCOL.md): a
control line, and for C{PUB}, C{MSG} and C{STATS} the payload and its line
end.  A datagram either arrives whole or not at all, so there is nothing to
reassemble and no stream to fall out of step: a malformed datagram is
refused on its own.

Every request a UDP client sends after its C{HELLO} ends with two options,
C{client=<client-id> token=<token>}: its identity, which the broker checks
against the datagram's source address and takes off before it reads the
request.  Both the broker (L{dallal.server.udp}) and the client
(L{dallal.client}) use this module.
"""

from dallal.errors import BAD_FRAMING, NO_ID, PAYLOAD_TOO_LARGE, RequestError

# The largest UDP payload over IPv4: 65,535 bytes less the IP and UDP
# headers (IPv6 allows 20 bytes more).
MAX_DATAGRAM = 65507

# The largest message payload carried over UDP.  The rest of the datagram
# is left for the frame around it: a MSG control line with a 256-byte
# topic, a 64-byte subscription id, its sequence number, delivery id and
# redelivery flag is under 450 bytes; a PUB line with the client's
# identity, under 400.
MAX_PAYLOAD = 65000

# What a UDP socket must be ready to receive: Twisted's default of 8192
# would silently truncate larger datagrams.
MAX_PACKET_SIZE = 65535

_CLIENT = b"client="
_TOKEN = b"token="


def splitDatagram(datagram):
    """
    Cut a datagram into its control line and what follows it.

    The line end may be CRLF or LF; a datagram without one is all control
    line (C{echo -n PING | nc -u} sends that).

    @return: C{(line, rest)}, the line without its line end.
    """
    end = datagram.find(b"\n")
    if end < 0:
        line, rest = datagram, b""
    else:
        line, rest = datagram[:end], datagram[end + 1 :]
        if line[-1:] == b"\r":
            line = line[:-1]
    return line, rest


def payloadOf(rest, size, requestId=NO_ID):
    """
    The payload of a frame whose control line announced C{size} bytes.

    @param rest: what followed the control line in the datagram.
    @raise RequestError: C{rest} is not exactly C{size} bytes and a line
        end.
    """
    if size > MAX_PAYLOAD:
        raise RequestError(
            PAYLOAD_TOO_LARGE,
            f"payload of {size} bytes is larger than the maximum of {MAX_PAYLOAD} over UDP",
            requestId,
        )
    if rest[size:] not in (b"\r\n", b"\n"):
        raise RequestError(
            BAD_FRAMING,
            f"the datagram does not hold the {size}-byte payload announced and its line end",
            requestId,
        )
    return rest[:size]


def checkNothingAfter(rest, requestId=NO_ID):
    """
    Refuse a datagram with bytes after a frame that has no payload.
    """
    if rest:
        raise RequestError(BAD_FRAMING, "one frame per datagram", requestId)


def takeIdentity(line):
    """
    Take the client's identity off the end of a request's control line.

    @return: C{(line, clientId, token)}: the request without its identity,
        and the identity as bytes, or C{None}s when the line does not end
        with C{client=... token=...}.
    """
    tokens = line.split()
    if len(tokens) >= 3 and tokens[-2].startswith(_CLIENT) and tokens[-1].startswith(_TOKEN):
        return (
            b" ".join(tokens[:-2]),
            tokens[-2][len(_CLIENT) :],
            tokens[-1][len(_TOKEN) :],
        )
    return line, None, None


def withIdentity(frame, clientId, token):
    """
    A request frame as the datagram a UDP client sends: its control line
    ends with the client's identity.

    @param frame: the frame as L{dallal.protocol.wire} encodes it: bytes, or a
        sequence of byte strings whose first is the control line; either
        way the control line ends with CRLF.
    """
    if isinstance(frame, bytes):
        line, rest = frame, ()
    else:
        line, *rest = frame
    identity = b" client=%s token=%s\r\n" % (clientId.encode("ascii"), token.encode("ascii"))
    return b"".join((line[:-2], identity, *rest))
