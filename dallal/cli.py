"""
The C{dallal} command: publish and subscribe from a shell.

    dallal [connection options] <host> <port> <command> [command options] ...

The lines it prints on standard output are the specification's; reasons for
a failure go to standard error.
"""

import argparse
import os
import sys

import json

from twisted.internet import defer, error as netError
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.task import deferLater, react
from twisted.python.failure import Failure

from dallal import __version__
from dallal.client import ServerError, SessionLost, connect, connectUDP
from dallal.delivery import MODES

DEFAULT_TIMEOUT = 10.0

PUBLISHED = "your message published successfully"
PUBLISH_FAILED = "your message publishing failed"
SUBSCRIBE_FAILED = "subscribing failed"


def _port(text):
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be a number, got {text!r}")
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 1-65535, got {port}")
    return port


def _timeout(text):
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"timeout must be a number, got {text!r}")
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"timeout must be positive, got {text}")
    return seconds


def buildParser():
    parser = argparse.ArgumentParser(
        prog="dallal",
        description="Publish to and subscribe on a Dallal broker.",
        epilog="Options about the connection come before <host>; options of a "
        "command come after its name: dallal 127.0.0.1 1373 publish --timeout 2 "
        "news hello. 'dallal <host> <port> <command> --help' describes a command.",
    )
    parser.add_argument("--version", action="version", version=f"dallal {__version__}")
    parser.add_argument(
        "--udp",
        action="store_true",
        help="talk to the broker over UDP instead of TCP",
    )
    parser.add_argument("host", help="the broker's host name or address")
    parser.add_argument(
        "port",
        type=_port,
        help="the broker's TCP port (1373 by default), or with --udp its UDP port "
        "(1234 in the specification)",
    )
    commands = parser.add_subparsers(dest="command", metavar="<command>", required=True)

    def addTimeout(command):
        command.add_argument(
            "--timeout",
            type=_timeout,
            default=DEFAULT_TIMEOUT,
            metavar="SECONDS",
            help="how long to wait for the broker's acknowledgement "
            f"(default {DEFAULT_TIMEOUT:g})",
        )

    publish = commands.add_parser(
        "publish",
        help="publish one message",
        description=f"Publish a message; prints '{PUBLISHED}' once the broker "
        "acknowledges it.",
    )
    addTimeout(publish)
    publish.add_argument(
        "--count",
        type=_positiveInt,
        default=1,
        metavar="N",
        help="publish the message N times; the success line is printed once "
        "all N are acknowledged (default 1)",
    )
    publish.add_argument(
        "--every",
        type=_nonNegative,
        default=0.0,
        metavar="SECONDS",
        help="wait this long between publishes; 0 (the default) sends them "
        "all at once, pipelined",
    )
    publish.add_argument("topic")
    publish.add_argument("message")

    subscribe = commands.add_parser(
        "subscribe",
        help="print the messages published on topics",
        description="Subscribe on one or more topics and print each message as "
        "'<topic>: <message>' until interrupted.",
    )
    addTimeout(subscribe)
    subscribe.add_argument(
        "--mode",
        choices=MODES,
        default=None,
        help="latest (the default): each message is acked, and a newer one "
        "replaces an older one not yet sent; all: every message is kept "
        "until acked; fire: no acks, fastest, may lose messages",
    )
    subscribe.add_argument("topics", nargs="+", metavar="topic")

    stats = commands.add_parser(
        "stats",
        help="print the broker's counters",
        description="Print the broker's counters as a table (see docs/EVENTS.md).",
    )
    addTimeout(stats)
    stats.add_argument("--json", action="store_true", help="print them as JSON")
    return parser


def _positiveInt(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _nonNegative(text):
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}")
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


class Deadline:
    """
    One time budget shared by the waits of a command.
    """

    def __init__(self, reactor, seconds):
        self.reactor = reactor
        self.seconds = seconds
        self._end = reactor.seconds() + seconds

    def wait(self, deferred):
        remaining = max(0.0, self._end - self.reactor.seconds())
        return deferred.addTimeout(remaining, self.reactor, onTimeoutCancel=_timedOut)


def _timedOut(result, timeout):
    # addTimeout's default only recognises a plain CancelledError; a
    # cancelled gatherResults fails with a FirstError wrapping one.
    if isinstance(result, Failure):
        raise defer.TimeoutError(f"no answer within {timeout:g} seconds")
    return result


def describe(failure, args):
    """
    One line saying why a command failed, for standard error.
    """
    where = f"{args.host}:{args.port}"
    if isinstance(failure, defer.FirstError):
        failure = failure.subFailure.value
    if isinstance(failure, defer.TimeoutError):
        return f"no answer from the broker at {where} within {args.timeout:g} seconds"
    if isinstance(failure, netError.ConnectionRefusedError):
        return f"connection refused by {where}: is the broker running?"
    if isinstance(failure, netError.DNSLookupError):
        return f"cannot resolve {args.host}"
    if isinstance(failure, SessionLost):
        return f"the broker at {where} no longer knows this client: {failure}"
    if isinstance(failure, (netError.ConnectionDone, netError.ConnectionLost)):
        return f"the broker at {where} closed the connection"
    if isinstance(failure, ServerError):
        return f"the broker refused the request: {failure}"
    if isinstance(failure, ValueError):
        return str(failure)
    return f"{type(failure).__name__}: {failure}"


def _fail(line, error, args):
    print(line, flush=True)
    print(f"dallal: {describe(error, args)}", file=sys.stderr, flush=True)
    raise SystemExit(1)


def _connect(reactor, args, deadline):
    if args.udp:
        where = f"{args.host}:{args.port}"

        def reportPongMissed(missed):
            print(
                f"dallal: no pong from the broker at {where} for {missed} ping "
                "interval(s); still trying",
                file=sys.stderr,
                flush=True,
            )

        connecting = connectUDP(reactor, args.host, args.port, onPongMissed=reportPongMissed)
    else:
        connecting = connect(reactor, HostnameEndpoint(reactor, args.host, args.port))
    return deadline.wait(connecting)


async def publishCommand(reactor, args):
    # fsencode gives back the exact bytes the shell passed.
    payload = os.fsencode(args.message)
    try:
        client = await _connect(reactor, args, Deadline(reactor, args.timeout))
        acks = []
        for number in range(args.count):
            if number and args.every:
                await deferLater(reactor, args.every)
            acks.append(client.publish(args.topic, payload))
        # The time limit runs from the last publish sent.
        await Deadline(reactor, args.timeout).wait(
            defer.gatherResults(acks, consumeErrors=True)
        )
    except Exception as error:
        _fail(PUBLISH_FAILED, error, args)
    print(PUBLISHED, flush=True)
    await client.close()


class MessagePrinter:
    """
    Prints C{<topic>: <message>} lines, holding back those that arrive
    before every subscription is acknowledged so that the
    C{subscribing on ...} line always comes first.

    A message is acked once its line is flushed: a held one when it is
    released.
    """

    def __init__(self, output):
        self.output = output
        self.held = []

    def __call__(self, message):
        if self.held is None:
            self.write(message)
            return None
        printed = defer.Deferred()
        self.held.append((message, printed))
        return printed

    def write(self, message):
        self.output.write(message.topic.encode("utf-8") + b": " + message.payload + b"\n")
        self.output.flush()

    def release(self):
        held, self.held = self.held, None
        for message, printed in held:
            self.write(message)
            printed.callback(None)


def reportGap(topic, missed):
    print(
        f"dallal: {topic}: {missed} message(s) not received "
        "(replaced by newer ones or dropped by the broker)",
        file=sys.stderr,
        flush=True,
    )


async def subscribeCommand(reactor, args):
    # Ctrl-C and SIGTERM stop the reactor, which closes the connection: that
    # is the user's way out, not a failure to report.
    stopping = []
    reactor.addSystemEventTrigger("before", "shutdown", stopping.append, True)
    deadline = Deadline(reactor, args.timeout)
    printer = MessagePrinter(sys.stdout.buffer)
    try:
        client = await _connect(reactor, args, deadline)
        await deadline.wait(
            client.subscribe(args.topics, printer, mode=args.mode, onGap=reportGap)
        )
    except Exception as error:
        _fail(SUBSCRIBE_FAILED, error, args)
    print("subscribing on " + " ".join(args.topics), flush=True)
    printer.release()
    await client.whenDisconnected()
    if stopping:
        return
    reason = client.lostReason.value if client.lostReason else None
    print(f"dallal: {describe(reason, args)}", file=sys.stderr, flush=True)
    raise SystemExit(1)


async def statsCommand(reactor, args):
    deadline = Deadline(reactor, args.timeout)
    try:
        client = await _connect(reactor, args, deadline)
        stats = await deadline.wait(client.stats())
    except Exception as error:
        print(f"dallal: {describe(error, args)}", file=sys.stderr, flush=True)
        raise SystemExit(1)
    if args.json:
        print(json.dumps(stats, sort_keys=True, indent=2), flush=True)
    else:
        width = max(map(len, stats))
        for name in sorted(stats):
            print(f"{name:<{width}}  {stats[name]}")
        sys.stdout.flush()
    await client.close()


COMMANDS = {
    "publish": publishCommand,
    "subscribe": subscribeCommand,
    "stats": statsCommand,
}


def main(argv=None):
    args = buildParser().parse_args(argv)

    def run(reactor):
        return defer.ensureDeferred(COMMANDS[args.command](reactor, args))

    react(run)
