"""
output-bound: no answer escapes the output bound.

A client subscribes with 1000 filters of 250 bytes, then, with a 4 KiB
receive buffer, sends 1000 pipelined LIST requests and never reads (each
answer is about 270 KB). Two more clients do the same with 1000 TOPICS
(the topics are those 1000 filters) and 20,000 STATS (about 1 KB each).

PASS if, for each, the broker's resident memory grows by less than 20 MiB
and the broker either closes the connection with a reason (its disconnect
event says a reason other than the client closing) or stops reading the
client's requests while its answers wait (they stay in the broker's
socket, as /proc/net/tcp shows).

With --broker dallal-mqtt, the MQTT form against Dallal's --mqtt. With
--broker redis|nats|mosquitto, the same never-reading client on a peer: Redis with 1000 pipelined GETs of a 270 KB value, NATS and Mosquitto
with 1000 messages of 270 KB published to a subject/topic the client
itself subscribes to.
"""

import re
import socket
import time

import attacklib as lib

NAME = "output-bound"
GROWTH_LIMIT = 20 * lib.MiB
FILTERS = 1000
BIG = 270_000
SETTLE = 6.0
FILLER_PINGS = 2_000_000


def growthWhile(server, send):
    """
    Run C{send}, then watch the broker's memory for a few seconds.

    @return: the largest growth seen, in bytes.
    """
    baseline = server.residentMemory()
    peak = baseline
    try:
        send()
    except (TimeoutError, BlockingIOError):
        pass  # the broker stopped reading: it did not take all the requests
    except (BrokenPipeError, ConnectionResetError):
        pass  # it closed the connection
    end = time.monotonic() + SETTLE
    while time.monotonic() < end:
        peak = max(peak, server.residentMemory())
        time.sleep(0.1)
    return peak - baseline


def sendAll(sock, data):
    sock.settimeout(5)
    sock.sendall(data)


def unreadBytes(serverPort, clientPort):
    """
    The bytes the client at 127.0.0.1:C{clientPort} sent that the server
    has not read (its socket's receive queue in /proc/net/tcp), or None if
    the connection is not there.
    """
    local = f"0100007F:{serverPort:04X}"
    remote = f"0100007F:{clientPort:04X}"
    with open("/proc/net/tcp") as table:
        for line in table:
            fields = line.split()
            if fields[1] == local and fields[2] == remote:
                return int(fields[4].split(":")[1], 16)
    return None


def disconnectReason(broker, port):
    """
    The reason the broker logged for ending the session of the client at
    127.0.0.1:C{port}, or None if it has not ended it.
    """
    found = re.search(
        rb"event=disconnect [^\n]*client=127\.0\.0\.1:%d [^\n]*reason=(\S+)" % port,
        lib.logText(broker),
    )
    return found.group(1).decode() if found else None


def attackDallal():
    with lib.scratch() as directory, lib.dallal(directory) as broker:
        lister = lib.Connection(broker.port, receiveBuffer=4096)
        for number in range(FILTERS):
            lister.send(b"SUB s%d f/%04d/%s\r\n" % (number, number, b"x" * 240))
            if number % 100 == 99:
                lister.answer(b"s%d" % number)
        lister.answer(b"s%d" % (FILTERS - 1))
        # The lister's filters are the topics TOPICS lists: it goes last.
        phases = [
            (
                "TOPICS",
                lambda: lib.Connection(broker.port, receiveBuffer=4096),
                b"TOPICS t\r\n" * 1000,
            ),
            (
                "STATS",
                lambda: lib.Connection(broker.port, receiveBuffer=4096),
                b"STATS s\r\n" * 20000,
            ),
            ("LIST", lambda: lister, b"LIST l\r\n" * 1000),
        ]
        results = []
        for verb, connect, requests in phases:
            connection = connect()
            # Then PINGs, more than the kernel's buffers hold: a broker that
            # stopped serving the connection leaves them unread.
            growth = growthWhile(
                broker,
                lambda connection=connection, requests=requests: sendAll(
                    connection.sock, requests + b"PING\r\n" * FILLER_PINGS
                ),
            )
            clientPort = connection.sock.getsockname()[1]
            reason = disconnectReason(broker, clientPort)
            stoppedReading = bool(unreadBytes(broker.port, clientPort))
            results.append((verb, requests.count(b"\n"), growth, reason, stoppedReading))
            connection.close()
            # What the broker held for it is freed once it sees the close.
            time.sleep(2)
    passed = all(
        growth < GROWTH_LIMIT and (reason not in (None, "closed") or stoppedReading)
        for _, _, growth, reason, stoppedReading in results
    )
    figure = "; ".join(
        f"{count} pipelined {verb} unread: RSS +{lib.mib(growth)}, "
        + (
            f"closed ({reason})"
            if reason
            else "the broker left its requests unread"
            if stoppedReading
            else "connection left open, requests all read"
        )
        for verb, count, growth, reason, stoppedReading in results
    )
    return passed, figure + (
        f" (limit: < {lib.mib(GROWTH_LIMIT)}, and closed with a reason or no more requests read)"
    )


def peerConnection(port):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    return sock


def closedByServer(sock, seconds=5.0):
    """
    Whether the server closed the connection: read (and forget) for a few
    seconds, until the end of the stream.
    """
    sock.settimeout(0.5)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            data = sock.recv(1 << 20)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
        if not data:
            return True
    return False


def attackPeer(kind):
    from protocols import mqttPacket, mqttString, redisCommand

    value = b"v" * BIG
    with lib.scratch() as directory, lib.brokerAndPort(kind, directory) as (server, port):
        sock = peerConnection(port)
        if kind == "redis":
            setter = socket.create_connection(("127.0.0.1", port))
            setter.sendall(redisCommand(b"SET", b"big", value))
            setter.recv(100)
            setter.close()
            requests = redisCommand(b"GET", b"big") * 1000
            what = "1000 pipelined GETs of a 270 KB value"
        elif kind == "nats":
            sock.sendall(b'CONNECT {"verbose":false}\r\nSUB x 1\r\n')
            requests = (b"PUB x %d\r\n%s\r\n" % (BIG, value)) * 1000
            what = "1000 270 KB messages to its own subscription"
        else:
            connect = mqttPacket(
                1, 0, mqttString(b"MQTT") + bytes([4, 2, 0, 60]) + mqttString(b"attacker")
            )
            subscribe = mqttPacket(8, 2, b"\x00\x01" + mqttString(b"x") + b"\x00")
            sock.sendall(connect + subscribe)
            time.sleep(0.3)
            requests = mqttPacket(3, 0, mqttString(b"x") + value) * 1000
            what = "1000 270 KB QoS 0 messages to its own subscription"
        growth = growthWhile(server, lambda: sendAll(sock, requests))
        # Dallal stops reading a client that does not read (its requests
        # stay in the socket), as over its own protocol.
        stoppedReading = kind == "dallal-mqtt" and bool(unreadBytes(port, sock.getsockname()[1]))
        closed = closedByServer(sock)
        sock.close()
    passed = growth < GROWTH_LIMIT and (closed or stoppedReading)
    state = "closed" if closed else "no longer read" if stoppedReading else "connection left open"
    return passed, f"{kind}: {what}, unread: RSS +{lib.mib(growth)}, {state}"


if __name__ == "__main__":
    lib.runAttack(
        NAME,
        __doc__,
        lambda options: (
            attackDallal() if options.broker == "dallal" else attackPeer(options.broker)
        ),
        peers=("dallal-mqtt", *lib.PEERS),
    )
