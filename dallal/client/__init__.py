"""
A Twisted client for Dallal brokers: a Deferred API, no threads.

    from dallal.client import connect

    async def main(reactor):
        client = await connect(reactor, "tcp:127.0.0.1:1373")
        await client.subscribe(["news"], lambda message: print(message.payload))
        await client.publish("news", b"hello")
        await client.close()

Requests are pipelined: each carries an id and the Deferred it returned
fires when the matching acknowledgement arrives (or fails with
L{ServerError} when the broker refuses it, or with the connection-lost
reason when the connection goes first).  The client answers the broker's
pings by itself, and acks each message once its handler is done with it.

L{connectUDP} gives the same API over UDP (PROTOCOL.md, "UDP"): the client
says HELLO, resends each request until it is answered (or its Deferred is
cancelled, by a timeout for instance), and pings the broker at the interval
the broker asks for.

Both log in to a broker that takes passwords when given
C{credentials=(user, password)}; the password is sent in the HELLO and kept
for nothing else (over UDP, for the HELLO that resumes a session from a new
address), and never logged.

The modules: L{dallal.client.tcp} and L{dallal.client.udp} (the two
transports), L{dallal.client.base} (what both do: requests, subscriptions,
acks), L{dallal.client.pending} (the requests waiting for their answers),
L{dallal.client.subscriptions}, L{dallal.client.errors} and
L{dallal.client.reconnect} (the delays of coming back).  Import the API from
here.
"""

from dallal.client.base import SERVER_ERRORS_KEPT, ClientBase, checkToken, loginOptions
from dallal.client.errors import ClientProtocolError, ClosedUnanswered, ServerError, SessionLost
from dallal.client.reconnect import (
    RECONNECT_FACTOR,
    RECONNECT_INITIAL_DELAY,
    RECONNECT_MAX_DELAY,
    reconnectDelays,
)
from dallal.client.subscriptions import ReceivedMessage
from dallal.client.tcp import DallalClientProtocol, connect, tlsEndpoint
from dallal.client.udp import REQUEST_WINDOW, DallalDatagramClient, connectUDP

__all__ = [
    "RECONNECT_FACTOR",
    "RECONNECT_INITIAL_DELAY",
    "RECONNECT_MAX_DELAY",
    "REQUEST_WINDOW",
    "SERVER_ERRORS_KEPT",
    "ClientBase",
    "ClientProtocolError",
    "ClosedUnanswered",
    "DallalClientProtocol",
    "DallalDatagramClient",
    "ReceivedMessage",
    "ServerError",
    "SessionLost",
    "checkToken",
    "connect",
    "connectUDP",
    "loginOptions",
    "reconnectDelays",
    "tlsEndpoint",
]
