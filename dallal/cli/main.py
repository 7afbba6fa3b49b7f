"""
The C{dallal} command: publish and subscribe from a shell, list the
broker's topics, and talk to it interactively (C{shell}, C{chat}).

    dallal [connection options] <host> <port> <command> [command options] ...

The lines it prints on standard output are the specification's; reasons for
a failure go to standard error.
"""

import argparse
import json
import os
import re
import stat
import sys
import textwrap

from twisted.internet import defer
from twisted.internet import error as netError
from twisted.internet.endpoints import HostnameEndpoint
from twisted.internet.interfaces import IReadDescriptor
from twisted.internet.main import CONNECTION_LOST
from twisted.internet.task import deferLater, react
from twisted.python.failure import Failure
from zope.interface import implementer

from dallal import __version__
from dallal.cli.askpass import PASSWORD_VARIABLE, NoTerminal, askPassword, passwordFromEnvironment
from dallal.cli.chat import Chat, checkNickname, defaultName
from dallal.cli.console import openConsole
from dallal.cli.shell import Shell, describeReach, formatTopics
from dallal.cli.shell import helpLines as shellHelpLines
from dallal.client import (
    RECONNECT_FACTOR,
    RECONNECT_INITIAL_DELAY,
    RECONNECT_MAX_DELAY,
    ClosedUnanswered,
    DallalClientProtocol,
    ServerError,
    SessionLost,
    connect,
    connectUDP,
    reconnectDelays,
    tlsEndpoint,
)
from dallal.errors import BAD_CREDENTIALS, BAD_TOPIC, CLOSING, NOT_AUTHORIZED
from dallal.modes import MODES
from dallal.names import checkUserName
from dallal.numbers import MAX_PORT, positiveNumber
from dallal.topics import WILDCARDS, checkTopic

DEFAULT_TIMEOUT = 10.0

PUBLISHED = "your message published successfully"
PUBLISH_FAILED = "your message publishing failed"
SUBSCRIBE_FAILED = "subscribing failed"

# The exit status of a command whose standard output was closed under it
# (C{dallal ... subscribe t | head -2}): that of a command SIGPIPE stops.
OUTPUT_GONE = 128 + 13

# Publishes of C{publish -l} sent and not yet acknowledged, at most: reading
# standard input waits beyond them, so a long input costs bounded memory.
PUBLISH_WINDOW = 100

# Any argument of publish that begins with one dash (-5C) and is not one of
# its options is a message (argparse takes only negative numbers so).
_DASHED_MESSAGE = re.compile(r"^-[^-]")


def _number(**bounds):
    """
    An argparse converter of positive numbers (L{positiveNumber} with
    C{bounds}): argparse shows its error with the option's name.
    """

    def convert(text):
        return positiveNumber(text, error=argparse.ArgumentTypeError, **bounds)

    return convert


_port = _number(maximum=MAX_PORT)
_timeout = _number(kind=float)
_count = _number()
_interval = _number(kind=float, zero=True)


def _checked(check):
    """
    An argparse converter that takes a value C{check} passes as it is:
    argparse shows the ValueError C{check} raises as one line.
    """

    def convert(text):
        try:
            check(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from error
        return text

    return convert


_userName = _checked(checkUserName)
_name = _checked(checkNickname)


def buildParser():
    parser = argparse.ArgumentParser(
        prog="dallal",
        description="Publish to and subscribe on a Dallal broker, list its topics, "
        "or talk to it interactively (shell, chat).",
        epilog="Options about the connection come before <host>; options of a "
        "command come after its name: dallal 127.0.0.1 1373 publish --timeout 2 "
        "news hello. 'dallal <host> <port> <command> --help' describes a command.",
    )
    parser.add_argument("--version", action="version", version=f"dallal {__version__}")
    transport = parser.add_mutually_exclusive_group()
    transport.add_argument(
        "--udp",
        action="store_true",
        help="talk to the broker over UDP instead of TCP",
    )
    transport.add_argument(
        "--tls",
        action="store_true",
        help="talk to the broker over TLS (its --tcp ssl:... port); its "
        "certificate must be for <host> and signed by a CA of --cafile, or of "
        "the system's roots",
    )
    parser.add_argument(
        "--cafile",
        metavar="CA",
        default=None,
        help="with --tls: a PEM file of the CA certificate(s) to trust instead of the system's",
    )
    parser.add_argument(
        "--user",
        metavar="NAME",
        type=_userName,
        default=None,
        help="log in as NAME (a broker run with --passwords requires it); the "
        f"password comes from the {PASSWORD_VARIABLE} environment variable, or "
        "is asked for on the terminal, without echo",
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
            help=f"how long to wait for the broker's acknowledgement (default {DEFAULT_TIMEOUT:g})",
        )

    publish = commands.add_parser(
        "publish",
        help="publish one message",
        description=f"Publish a message; prints '{PUBLISHED}' once the broker "
        "acknowledges it.  A topic is made of levels separated by '/' "
        "(weather/minnesota); the wildcards + and # only go in the filters of "
        "subscriptions and of --to-matching.  A message may begin with '-' "
        "(-5C); one that begins like an option (-h, -l, -f, --...) goes after "
        "'--': publish news -- --all-clear.",
    )
    addTimeout(publish)
    how = publish.add_mutually_exclusive_group()
    how.add_argument(
        "--retain",
        action="store_true",
        help="also keep it as the topic's retained message, which every new "
        "subscription to the topic receives, across broker restarts; an empty "
        "message clears it",
    )
    how.add_argument(
        "--to-matching",
        action="store_true",
        help="the topic is a filter (WEATHER/# or a/+/c): publish on every "
        "existing topic it matches (topics with a retained message or a "
        "subscriber by name), and print on a second line how many it reached",
    )
    publish.add_argument(
        "--count",
        type=_count,
        default=None,
        metavar="N",
        help="publish the message N times; the success line is printed once "
        "all N are acknowledged (default 1)",
    )
    publish.add_argument(
        "--every",
        type=_interval,
        default=None,
        metavar="SECONDS",
        help="with --count: wait this long between publishes; 0 (the "
        "default) sends them all at once, pipelined",
    )
    source = publish.add_mutually_exclusive_group()
    source.add_argument(
        "-l",
        "--stdin-line",
        action="store_true",
        help="instead of <message>: publish each line read from standard "
        "input as a message, as it is read (empty lines are skipped); the "
        "success line is printed once the input ended and all are "
        "acknowledged",
    )
    source.add_argument(
        "-f",
        "--file",
        metavar="FILE",
        help="instead of <message>: publish the content of FILE as the message",
    )
    publish.add_argument("topic", help="a topic; with --to-matching a topic filter")
    publish.add_argument("message", nargs="?", help="the message (or -l, or -f FILE)")
    # Once its options are added: argparse would take those that match it
    # (-l, -f) for negative numbers, and then no argument for one.
    publish._negative_number_matcher = _DASHED_MESSAGE

    subscribe = commands.add_parser(
        "subscribe",
        help="print the messages published on topics",
        description="Subscribe on one or more topics and print each message as "
        "'<topic>: <message>' until interrupted.  A topic may be a filter: + "
        "matches one level (a/+ gets a/x, not a/x/y), # every level below (a/# "
        "gets a, a/x and a/x/y).  The topics' retained messages come first.",
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
    subscribe.add_argument(
        "--reconnect",
        action="store_true",
        help="when the connection is lost (the broker restarts), connect and "
        f"subscribe again, after about {RECONNECT_INITIAL_DELAY * RECONNECT_FACTOR:g} s, then "
        f"twice as long after each failure, up to {RECONNECT_MAX_DELAY:g} s, and say "
        "so on standard error; until interrupted",
    )
    subscribe.add_argument("topics", nargs="+", metavar="topic")

    stats = commands.add_parser(
        "stats",
        help="print the broker's counters",
        description="Print the broker's counters as a table (see docs/EVENTS.md).",
    )
    addTimeout(stats)
    stats.add_argument("--json", action="store_true", help="print them as JSON")

    topics = commands.add_parser(
        "topics",
        help="list the broker's topics",
        description="List the topics the broker knows (those with a retained "
        "message, and those clients subscribe to, filters included) with the "
        "size of their retained message and their number of subscribers; a "
        "last line says when some were left out.",
    )
    addTimeout(topics)
    topics.add_argument(
        "--limit",
        type=_count,
        default=None,
        metavar="N",
        help="list at most N topics, in alphabetical order (the broker lists at most 1000)",
    )
    topics.add_argument("--json", action="store_true", help="print them as JSON")

    shell = commands.add_parser(
        "shell",
        help="an interactive session with slash commands",
        # The list of slash commands keeps its lines.
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="\n\n".join(
            [
                _paragraph(
                    "One connection to the broker, driven by commands read from "
                    "standard input, one per line:"
                ),
                "\n".join("  " + line for line in shellHelpLines()),
                _paragraph(
                    "Messages print as '<topic>: <message>' as they arrive.  On a "
                    "terminal the line being typed stays below them, with history "
                    "(Up, Down) and editing; from a pipe there is no prompt, errors "
                    "go to standard error, and the end of the input disconnects.  "
                    "Exit status 0 after /disc or the end of input, 1 if the "
                    "connection fails or is lost."
                ),
            ]
        ),
    )
    addTimeout(shell)

    chat = commands.add_parser(
        "chat",
        help="chat with others on a topic",
        description="Two-way chat: each line read is published on the topic as "
        "'<name>: <line>', and every line others publish there is printed as "
        "it comes (one's own are not printed again).  The end of input (Ctrl-D, "
        "or Ctrl-C on a terminal) leaves.",
    )
    addTimeout(chat)
    chat.add_argument(
        "--name",
        type=_name,
        default=None,
        help="the name your lines are signed with (default: user@host)",
    )
    chat.add_argument("topic", type=_plainTopic, help="the topic to chat on (no wildcards)")
    return parser


def _paragraph(text):
    return textwrap.fill(text, width=79)


def _plainTopic(text):
    try:
        checkTopic(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error}") from error
    return text


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


def _cause(error):
    """
    The error itself, when the first of several pipelined requests failed.
    """
    if isinstance(error, defer.FirstError):
        return error.subFailure.value
    return error


def describe(failure, args):
    """
    One line saying why a command failed, for standard error.
    """
    where = f"{args.host}:{args.port}"
    failure = _cause(failure)
    if isinstance(failure, defer.TimeoutError):
        return f"no answer from the broker at {where} within {args.timeout:g} seconds"
    if isinstance(failure, netError.ConnectionRefusedError):
        return f"connection refused by {where}: is the broker running?"
    if isinstance(failure, netError.DNSLookupError):
        return f"cannot resolve {args.host}"
    if isinstance(failure, SessionLost):
        return f"the broker at {where} no longer knows this client: {failure}"
    if isinstance(failure, (netError.ConnectionDone, netError.ConnectionLost)):
        if isinstance(failure, ClosedUnanswered) and not args.tls:
            return (
                f"the broker at {where} closed the connection before answering: "
                "probably a TLS port (add --tls)"
            )
        return f"the broker at {where} closed the connection"
    if isinstance(failure, ServerError) and failure.code == BAD_CREDENTIALS:
        return f"the broker at {where} refused the login: {failure.reason}"
    if isinstance(failure, ServerError) and failure.code == NOT_AUTHORIZED and not args.user:
        return (
            f"the broker at {where} requires a login: give --user NAME (the password "
            f"from {PASSWORD_VARIABLE}, or typed when asked)"
        )
    if isinstance(failure, ServerError):
        if failure.code in CLOSING and not args.udp:
            return f"the broker at {where} closed the connection: {failure}"
        return f"the broker refused the request: {failure}"
    tls = _tlsReason(failure, args.host)
    if tls is not None:
        if any(sign in tls for sign in _PLAIN_PORT_SIGNS):
            tls += " (probably a plain TCP port, not TLS: try without --tls)"
        return f"TLS with the broker at {where} failed: {tls}"
    if isinstance(failure, ValueError):
        return str(failure)
    return f"{type(failure).__name__}: {failure}"


# What OpenSSL says when the other side does not speak TLS.
_PLAIN_PORT_SIGNS = ("wrong version number", "packet length too long", "record layer failure")


def _tlsReason(error, host):
    """
    Why a TLS connection failed, in words, or C{None} if C{error} is not
    about TLS.
    """
    module = type(error).__module__
    if module.startswith("OpenSSL"):
        # pyOpenSSL's errors are lists of (library, function, reason).
        reasons = [
            entry[-1]
            for entry in (error.args[0] if error.args and isinstance(error.args[0], list) else [])
            if isinstance(entry, tuple) and entry and entry[-1]
        ]
        reason = "; ".join(reasons) or str(error) or type(error).__name__
        if "certificate verify failed" in reasons:
            reason += " (the broker's certificate is not signed by a trusted CA: see --cafile)"
        return reason
    if module.startswith("service_identity"):
        return f"the broker's certificate is not for {host} (its subjectAltName does not name it)"
    return None


def _fail(line, error, args, hint=None):
    print(line, flush=True)
    _exitWith(error, args, hint)


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

        connecting = connectUDP(
            reactor,
            args.host,
            args.port,
            onPongMissed=reportPongMissed,
            credentials=args.credentials,
        )
    elif args.tls:
        try:
            endpoint = tlsEndpoint(reactor, args.host, args.port, args.cafile)
        except ImportError:
            raise ValueError("--tls needs pyOpenSSL: pip install 'twisted[tls]'") from None
        connecting = connect(reactor, endpoint, args.credentials)
    else:
        connecting = connect(
            reactor, HostnameEndpoint(reactor, args.host, args.port), args.credentials
        )
    return deadline.wait(connecting).addCallback(_noteAnonymous, args)


def _noteAnonymous(client, args):
    """
    Say so when C{--user} was given to a broker that takes no passwords.
    """
    if args.user is not None and client.user is None:
        print(
            f"dallal: the broker at {args.host}:{args.port} takes no passwords: "
            f"connected anonymously, not as {args.user}",
            file=sys.stderr,
            flush=True,
        )
    return client


def _publishOnce(client, args, payload):
    if args.to_matching:
        return client.publishToMatching(args.topic, payload)
    return client.publish(args.topic, payload, retain=args.retain)


def _publishHint(error, args):
    """
    What to do instead, when a wildcard made the broker refuse the topic.
    """
    error = _cause(error)
    refusedFilter = (
        isinstance(error, ServerError)
        and error.code == BAD_TOPIC
        and not args.to_matching
        and not WILDCARDS.isdisjoint(args.topic)
    )
    if refusedFilter:
        return "publish --to-matching publishes on every topic a filter matches"
    return None


async def publishCommand(reactor, args):
    if args.stdin_line:
        await _publishLines(reactor, args)
        return
    try:
        client = await _connect(reactor, args, Deadline(reactor, args.timeout))
        acks = []
        for number in range(args.count or 1):
            if number and args.every:
                await deferLater(reactor, args.every)
            acks.append(_publishOnce(client, args, args.payload))
        # The time limit runs from the last publish sent.
        answers = await Deadline(reactor, args.timeout).wait(
            defer.gatherResults(acks, consumeErrors=True)
        )
    except Exception as error:
        _fail(PUBLISH_FAILED, error, args, _publishHint(error, args))
    print(PUBLISHED, flush=True)
    if args.to_matching:
        print(describeReach(args.topic, answers), flush=True)
    await client.close()


class LinePublisher:
    """
    The handler of the console of C{publish -l}: publishes each line read
    as a message as soon as it is read (empty lines are skipped), with at
    most C{window} unacknowledged; reading from a pipe or a file waits
    meanwhile.

    @ivar finished: fires with the broker's answers once the input ended
        and every message is acknowledged, or fails with the first
        failure.
    """

    def __init__(self, console, publishOne, window=PUBLISH_WINDOW):
        """
        @param publishOne: called with a payload, returns a Deferred of the
            broker's answer (with its own time limit).
        """
        self.console = console
        self.publishOne = publishOne
        self.window = window
        self.finished = defer.Deferred()
        self._answers = []
        self._unacknowledged = 0
        self._inputEnded = False
        self._paused = False

    def lineReceived(self, line):
        if self.finished.called or not line:
            return
        self._unacknowledged += 1
        self.publishOne(line.encode("utf-8", "surrogateescape")).addCallbacks(
            self._acknowledged, self._failed
        )
        # A person typing never fills the window.
        if self._unacknowledged >= self.window and not self.console.interactive:
            self._paused = True
            self.console.pauseProducing()

    def _acknowledged(self, answer):
        self._answers.append(answer)
        self._unacknowledged -= 1
        if self._paused:
            self._paused = False
            self.console.resumeProducing()
        self._finishIfDone()

    def _failed(self, failure):
        self._unacknowledged -= 1
        if not self.finished.called:
            self.finished.errback(failure)

    def inputEnded(self):
        self._inputEnded = True
        self._finishIfDone()

    def _finishIfDone(self):
        if self._inputEnded and not self._unacknowledged and not self.finished.called:
            self.finished.callback(self._answers)


class NothingToPublish(ValueError):
    """
    C{publish -l} read no line that was not empty.
    """

    def __str__(self):
        return "standard input had no message (empty lines are skipped)"


async def _publishLines(reactor, args):
    """
    C{publish -l}: each line of standard input is a message.
    """
    try:
        client = await _connect(reactor, args, Deadline(reactor, args.timeout))
    except Exception as error:
        _fail(PUBLISH_FAILED, error, args)
    console = openConsole(
        reactor,
        f"{args.topic}> ",
        lambda console: LinePublisher(
            console,
            lambda payload: Deadline(reactor, args.timeout).wait(
                _publishOnce(client, args, payload)
            ),
        ),
    )
    try:
        answers = await console.handler.finished
        if not answers:
            raise NothingToPublish()
    except Exception as error:
        # Through the console, which owns standard output meanwhile.
        console.printLine(PUBLISH_FAILED)
        await console.close()
        await client.close()
        _exitWith(error, args, _publishHint(error, args))
    console.printLine(PUBLISHED)
    if args.to_matching:
        console.printLine(describeReach(args.topic, answers))
    await console.close()
    await client.close()


class MessagePrinter:
    """
    Prints C{<topic>: <message>} lines, holding back those that arrive
    before every subscription is acknowledged so that the
    C{subscribing on ...} line always comes first.

    A message is acked once its line is flushed: a held one when it is
    released.  One whose line cannot be written, standard output being
    closed, is never acked.

    @ivar outputGone: fires once standard output is found closed.
    """

    def __init__(self, output):
        self.output = output
        self.held = []
        self.outputGone = defer.Deferred()

    def __call__(self, message):
        if self.held is None:
            return self.write(message)
        printed = defer.Deferred()
        self.held.append((message, printed))
        return printed

    def write(self, message):
        """
        Print one message.

        @return: C{None} once it is written; if it cannot be, a Deferred
            that never fires, so that the message is never acked.
        """
        if not self.outputGone.called:
            try:
                self.output.write(message.topic.encode("utf-8") + b": " + message.payload + b"\n")
                self.output.flush()
                return None
            except BrokenPipeError:
                self.closed()
        return defer.Deferred()

    def closed(self):
        """
        Standard output is closed: whoever read it is gone.
        """
        if not self.outputGone.called:
            self.outputGone.callback(None)

    def release(self):
        held, self.held = self.held, None
        for message, printed in held:
            if self.write(message) is None:
                printed.callback(None)


@implementer(IReadDescriptor)
class _ReaderWatch:
    """
    Notices that the pipe on standard output lost its reader (C{head} has
    its lines) without writing to it: the writing end of a pipe polls
    readable (or in error) only then.
    """

    def __init__(self, descriptor, onGone):
        self.descriptor = descriptor
        self.onGone = onGone

    def fileno(self):
        return self.descriptor

    def doRead(self):
        return CONNECTION_LOST

    def connectionLost(self, reason):
        self.onGone()

    def logPrefix(self):
        return "standard output"


def watchOutput(reactor, onGone, descriptor=1):
    """
    Call C{onGone} when nobody reads standard output any more, if it is a
    pipe (a terminal or a file has no reader to lose).
    """
    if stat.S_ISFIFO(os.fstat(descriptor).st_mode):
        watch = _ReaderWatch(descriptor, onGone)
        reactor.addReader(watch)
        # Not to be told the pipe is lost when the reactor stops.
        reactor.addSystemEventTrigger("before", "shutdown", reactor.removeReader, watch)


def leaveWithOutputGone():
    """
    Exit as a command whose standard output was closed: at once, silently,
    with status L{OUTPUT_GONE}.  What is still buffered for standard output
    goes nowhere (Python would fail to flush it at exit, and say so).
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    raise SystemExit(OUTPUT_GONE)


def reportGap(topic, missed):
    print(
        f"dallal: {topic}: {missed} message(s) not received "
        "(replaced by newer ones or dropped by the broker)",
        file=sys.stderr,
        flush=True,
    )


def reportEnded(topic, error):
    print(f"dallal: {error.reason}", file=sys.stderr, flush=True)


def _say(text):
    print(f"dallal: {text}", file=sys.stderr, flush=True)


async def _subscribe(reactor, args, printer):
    """
    Connect and subscribe on the topics of C{args}.

    @return: the client, once every subscription is acknowledged.
    """
    deadline = Deadline(reactor, args.timeout)
    client = await _connect(reactor, args, deadline)
    try:
        await deadline.wait(
            client.subscribe(
                args.topics, printer, mode=args.mode, onGap=reportGap, onEnded=reportEnded
            )
        )
    except Exception:
        client.close()
        raise
    return client


def _firstOf(*deferreds):
    """
    A Deferred that fires once the first of C{deferreds} fires.
    """
    return defer.DeferredList(list(deferreds), fireOnOneCallback=True, consumeErrors=True)


async def subscribeCommand(reactor, args):
    # Ctrl-C and SIGTERM stop the reactor, which closes the connection: that
    # is the user's way out, not a failure to report.
    stopping = []
    reactor.addSystemEventTrigger("before", "shutdown", stopping.append, True)
    printer = MessagePrinter(sys.stdout.buffer)
    watchOutput(reactor, printer.closed)
    try:
        client = await _subscribe(reactor, args, printer)
    except Exception as error:
        _fail(SUBSCRIBE_FAILED, error, args)
    print("subscribing on " + " ".join(args.topics), flush=True)
    printer.release()
    while True:
        await _firstOf(client.whenDisconnected(), printer.outputGone)
        if printer.outputGone.called:
            # What could not be printed is not acked: the broker counts
            # it dropped once the connection is closed.
            await client.close()
            leaveWithOutputGone()
        if stopping:
            return
        reason = describe(client.lostReason.value if client.lostReason else None, args)
        if not args.reconnect:
            _say(reason)
            raise SystemExit(1)
        client = await _subscribeAgain(reactor, args, printer, reason)


async def _subscribeAgain(reactor, args, printer, reason):
    """
    Connect and subscribe again after the connection was lost, trying
    with a growing delay, until it works or the broker refuses the
    subscriptions.

    @param reason: why the connection was lost, in words.
    @return: the new client, subscribed.
    """
    delay = reconnectDelays()
    attempt = 1
    while True:
        seconds = delay(attempt)
        _say(f"{reason} (connecting again in {seconds:.1f} s)")
        await _firstOf(deferLater(reactor, seconds), printer.outputGone)
        if printer.outputGone.called:
            leaveWithOutputGone()
        try:
            client = await _subscribe(reactor, args, printer)
        except ServerError as error:
            if error.code not in CLOSING:
                _exitWith(error, args)
            reason = describe(error, args)
        except Exception as error:
            reason = describe(error, args)
        else:
            topics = " ".join(args.topics)
            _say(f"connected to {args.host}:{args.port} again, subscribed on {topics}")
            return client
        attempt += 1


def _exitWith(error, args, hint=None):
    reason = describe(error, args)
    if hint is not None:
        reason = f"{reason} ({hint})"
    _say(reason)
    raise SystemExit(1)


async def _query(reactor, args, ask):
    """
    Connect, ask the broker one question, print the answer as JSON if the
    user asked for it, and close.

    @param ask: called with the client, returns a Deferred of the answer.
    @return: the answer, when it is to be printed otherwise.
    """
    deadline = Deadline(reactor, args.timeout)
    try:
        client = await _connect(reactor, args, deadline)
        answer = await deadline.wait(ask(client))
    except Exception as error:
        _exitWith(error, args)
    await client.close()
    if args.json:
        print(json.dumps(answer, sort_keys=True, indent=2), flush=True)
        return None
    return answer


async def statsCommand(reactor, args):
    stats = await _query(reactor, args, lambda client: client.stats())
    if stats is not None:
        for line in formatStats(stats):
            print(line)
        sys.stdout.flush()


def formatStats(stats):
    """
    The lines of C{dallal stats}: a counter per line, then a line per
    bridge with its state and counts.
    """
    bridges = stats.pop("bridges", {})
    width = max(map(len, stats))
    lines = [f"{name:<{width}}  {stats[name]}" for name in sorted(stats)]
    for name, status in sorted(bridges.items()):
        fields = " ".join(f"{key}={value}" for key, value in sorted(status.items()))
        lines.append(f"bridge {name}: {fields}")
    return lines


async def topicsCommand(reactor, args):
    topics = await _query(reactor, args, lambda client: client.topics(args.limit))
    if topics is not None:
        for line in formatTopics(topics):
            print(line)
        sys.stdout.flush()


def _sayBye(client):
    # Over TCP the broker answers BYE and closes; over UDP close() says BYE.
    if isinstance(client, DallalClientProtocol):
        return client.bye
    return client.close


async def _consoleCommand(reactor, args, prompt, makeSession):
    """
    Run a L{dallal.cli.shell.ConsoleClient} on standard input and output.

    @param makeSession: called with the client, the console and the
        function that says BYE; returns the session.
    """
    try:
        client = await _connect(reactor, args, Deadline(reactor, args.timeout))
    except Exception as error:
        _exitWith(error, args)
    console = openConsole(
        reactor, prompt, lambda console: makeSession(client, console, _sayBye(client))
    )
    session = console.handler
    reactor.addSystemEventTrigger("before", "shutdown", session.interrupted)
    session.start()
    status = await session.finished
    await console.close()
    if status:
        raise SystemExit(status)


async def shellCommand(reactor, args):
    await _consoleCommand(
        reactor,
        args,
        "dallal> ",
        lambda client, console, sayBye: Shell(reactor, client, console, args.timeout, sayBye),
    )


async def chatCommand(reactor, args):
    name = args.name if args.name is not None else defaultName()
    await _consoleCommand(
        reactor,
        args,
        f"{name}: ",
        lambda client, console, sayBye: Chat(
            reactor, client, console, args.timeout, sayBye, args.topic, name
        ),
    )


def _stopIfOutputGone(failure):
    failure.trap(BrokenPipeError)
    leaveWithOutputGone()


COMMANDS = {
    "publish": publishCommand,
    "subscribe": subscribeCommand,
    "stats": statsCommand,
    "topics": topicsCommand,
    "shell": shellCommand,
    "chat": chatCommand,
}


def _checkPublish(parser, args):
    """
    Check the options of C{publish} that go together, and set
    C{args.payload}: the message as bytes, or C{None} with C{-l}.
    """
    given = [args.message is not None, args.stdin_line, args.file is not None]
    if sum(given) != 1:
        parser.error("publish takes one of: a message, -l, -f FILE")
    if args.every is not None and args.count is None:
        parser.error("--every goes with --count")
    if args.stdin_line and args.count is not None:
        parser.error("--count goes with one message, not with -l")
    if args.file is not None:
        try:
            with open(args.file, "rb") as source:
                args.payload = source.read()
        except OSError as error:
            parser.error(f"-f {args.file}: {error.strerror}")
    elif args.message is not None:
        # fsencode gives back the exact bytes the shell passed.
        args.payload = os.fsencode(args.message)
    else:
        args.payload = None


def main(argv=None):
    parser = buildParser()
    args = parser.parse_args(argv)
    if args.cafile is not None and not args.tls:
        parser.error("--cafile goes with --tls")
    if args.command == "publish":
        _checkPublish(parser, args)
    args.credentials = None
    if args.user is not None:
        password = passwordFromEnvironment()
        try:
            if password is None:
                password = askPassword(f"password of {args.user} at {args.host}:{args.port}: ")
        except NoTerminal as error:
            parser.error(f"--user: {error}")
        except (EOFError, KeyboardInterrupt):
            # Ctrl-D or Ctrl-C at the prompt: the user gave up.
            print(file=sys.stderr)
            raise SystemExit(1) from None
        args.credentials = (args.user, password)

    def run(reactor):
        running = defer.ensureDeferred(COMMANDS[args.command](reactor, args))
        return running.addErrback(_stopIfOutputGone)

    react(run)
