"""
C{dallal <host> <port> shell}: one connection to the broker, driven by
slash commands typed on a console (L{dallal.cli.console}).

    /sub <filter> [latest|all|fire]   /unsub <filter>
    /pub <topic> <message...>         /pubr <topic> [message...]
    /list   /topics [limit]   /disc   /help

Each command's answer, or one line saying why it failed, is printed before
the next command runs; messages are printed as C{<topic>: <message>} as
they arrive.  Also what the C{topics} command and C{publish --to-matching}
print.
"""

from dataclasses import dataclass

from twisted.internet.defer import Deferred, DeferredLock, TimeoutError, ensureDeferred
from twisted.internet.error import ConnectionDone, ConnectionLost

from dallal.client import ServerError, SessionLost
from dallal.modes import MODES
from dallal.numbers import wholeNumber
from dallal.topics import WILDCARDS


def plural(count, word):
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


class UsageError(Exception):
    """
    A command typed wrong; the message says how to type it.
    """


def describeError(error, timeout):
    """
    One line for a person saying why a request failed.
    """
    if isinstance(error, ServerError):
        return f"{error.reason} ({error.code})"
    if isinstance(error, TimeoutError):
        return f"no answer from the broker within {timeout:g} seconds"
    if isinstance(error, SessionLost):
        return f"the broker no longer knows this client: {error}"
    if isinstance(error, ConnectionDone):
        return "the broker closed the connection"
    if isinstance(error, ConnectionLost):
        return "the connection to the broker was lost"
    if isinstance(error, (UsageError, ValueError)):
        return str(error)
    return f"{type(error).__name__}: {error}"


def describeReach(topicFilter, counts):
    """
    How many topics a publish to every topic matching C{topicFilter}
    reached, given the count each publish reached.
    """
    fewest, most = min(counts), max(counts)
    if not most:
        return f"no topic matches {topicFilter}"
    if fewest == most:
        return f"published on {plural(most, 'topic')}"
    return f"published on {fewest} to {most} topics"


def formatSubscriptions(document):
    """
    The lines that show the answer to C{LIST}.
    """
    subscriptions = document["subscriptions"]
    if not subscriptions:
        return ["no subscriptions"]
    return [f"{plural(len(subscriptions), 'subscription')}:"] + [
        f"  {entry['filter']} ({entry['mode']})" for entry in subscriptions
    ]


def formatTopics(document):
    """
    The lines that show the answer to C{TOPICS}: a table of the topics,
    their retained message's size and their subscribers, and a last line
    when some were left out.
    """
    topics = document["topics"]
    lines = []
    if topics:
        rows = [("TOPIC", "RETAINED", "SUBSCRIBERS")] + [
            (
                entry["topic"],
                "-" if entry["retained_bytes"] is None else plural(entry["retained_bytes"], "byte"),
                str(entry["subscribers"]),
            )
            for entry in topics
        ]
        widths = [max(len(row[column]) for row in rows) for column in range(2)]
        lines = [
            f"{topic:<{widths[0]}}  {retained:<{widths[1]}}  {subscribers}"
            for topic, retained, subscribers in rows
        ]
    elif not document["total"]:
        lines = ["no topics"]
    if document["truncated"]:
        lines.append(f"(showing {len(topics)} of {document['total']} topics)")
    return lines


class ConsoleClient:
    """
    A client connection driven from a console: one line at a time, each
    done (answered, failed or timed out) before the next starts; leaving
    says BYE.

    @ivar finished: fires with the exit status once the session is over:
        0 when the user left or stopped the process, 1 when the connection
        was lost.
    """

    def __init__(self, clock, client, console, timeout, sayBye):
        """
        @param timeout: seconds to wait for each answer from the broker.
        @param sayBye: leaves the broker gracefully; returns a Deferred that
            fires once the connection is closed.
        """
        self.clock = clock
        self.client = client
        self.console = console
        self.timeout = timeout
        self._sayBye = sayBye
        self._lock = DeferredLock()
        self._leaving = False
        self.finished = Deferred()
        client.whenDisconnected().addCallback(self._disconnected)

    def start(self):
        """
        Begin, once the console reads and prints.
        """
        raise NotImplementedError

    def lineReceived(self, line):
        self._lock.run(self._handleLine, line)

    def inputEnded(self):
        self._lock.run(self._leave)

    def execute(self, line):
        """
        Carry out one line of input.

        @return: a coroutine.
        """
        raise NotImplementedError

    def _handleLine(self, line):
        if self._leaving:
            return None
        return ensureDeferred(self.execute(line)).addErrback(self._failed)

    def _failed(self, failure):
        if failure.check(ConnectionDone, ConnectionLost):
            # Said once, by _disconnected.
            return
        self.console.printError(describeError(failure.value, self.timeout))

    def answer(self, deferred):
        """
        Wait for the broker's answer for at most the timeout.
        """
        return deferred.addTimeout(self.timeout, self.clock)

    async def _leave(self):
        if self._leaving:
            return
        self._leaving = True
        try:
            await self.answer(self._sayBye())
        except TimeoutError:
            self.client.close()
            self.console.printError(
                f"the broker did not answer BYE within {self.timeout:g} seconds"
            )
            self.finished.callback(1)
            return
        self.console.printLine("disconnected")
        self.finished.callback(0)

    def interrupted(self):
        """
        The process is told to stop (Ctrl-C from a pipe, SIGTERM): that is
        the user's way out, not a failure to report.
        """
        self._leaving = True
        if not self.finished.called:
            self.finished.callback(0)

    def _disconnected(self, _):
        if self._leaving:
            return
        self._leaving = True
        self.console.printError(describeError(self.client.lostReason.value, self.timeout))
        self.finished.callback(1)


@dataclass(frozen=True)
class _Command:
    """
    A slash command: how it is typed and what it does.

    @ivar words: the fewest and most arguments it takes.
    @ivar text: whether its last argument is the rest of the line, spaces
        included (a message).
    """

    usage: str
    summary: str
    method: str
    words: tuple
    text: bool = False


COMMANDS = {
    "/sub": _Command(
        f"/sub <filter> [{'|'.join(MODES)}]",
        "subscribe; + matches one level, # all below",
        "_subscribe",
        (1, 2),
    ),
    "/unsub": _Command("/unsub <filter>", "end a subscription", "_unsubscribe", (1, 1)),
    "/pub": _Command(
        "/pub <topic> <message...>",
        "publish; with + or # on every matching topic",
        "_publish",
        (2, 2),
        text=True,
    ),
    "/pubr": _Command(
        "/pubr <topic> [message...]",
        "publish and retain it; no message clears it",
        "_publishRetained",
        (1, 2),
        text=True,
    ),
    "/list": _Command("/list", "your subscriptions", "_list", (0, 0)),
    "/topics": _Command("/topics [limit]", "the broker's topics", "_topics", (0, 1)),
    "/disc": _Command("/disc", "disconnect and quit (also Ctrl-D, Ctrl-C)", "_disconnect", (0, 0)),
    "/help": _Command("/help", "this list", "_help", (0, 0)),
}


def helpLines():
    """
    Each command's usage and what it does, aligned.
    """
    width = max(len(command.usage) for command in COMMANDS.values())
    return [f"{command.usage:<{width}}  {command.summary}" for command in COMMANDS.values()]


def parseCommand(line):
    """
    @return: the L{_Command} a line invokes and its arguments, or C{None}
        for a blank line.
    @raise UsageError: it is not a command, or not typed right.
    """
    words = line.split(None, 1)
    if not words:
        return None
    name, rest = words[0], words[1] if len(words) > 1 else ""
    if not name.startswith("/"):
        raise UsageError("commands start with /, as in /pub news hello; /help lists them")
    command = COMMANDS.get(name.lower())
    if command is None:
        raise UsageError(f"unknown command {name}; /help lists the commands")
    fewest, most = command.words
    arguments = rest.split(None, most - 1) if command.text else rest.split()
    if not fewest <= len(arguments) <= most:
        raise UsageError(f"usage: {command.usage}")
    return command, arguments


class Shell(ConsoleClient):
    """
    The slash commands of C{dallal shell}.
    """

    def start(self):
        if self.console.interactive:
            self.console.printLine("connected; /help lists the commands")

    async def execute(self, line):
        parsed = parseCommand(line)
        if parsed is not None:
            command, arguments = parsed
            await getattr(self, command.method)(*arguments)

    def _messageReceived(self, message):
        self.console.printMessage(f"{message.topic}: ", message.payload)

    async def _subscribe(self, topicFilter, mode=None):
        if mode is not None and mode not in MODES:
            raise UsageError(f"no mode {mode!r}; usage: {COMMANDS['/sub'].usage}")
        await self.answer(self.client.subscribe([topicFilter], self._messageReceived, mode))
        self.console.printLine(f"subscribed to {topicFilter}")

    async def _unsubscribe(self, topicFilter):
        await self.answer(self.client.unsubscribe(topicFilter))
        self.console.printLine(f"unsubscribed from {topicFilter}")

    async def _publish(self, topic, message):
        payload = message.encode("utf-8", "surrogateescape")
        if WILDCARDS.isdisjoint(topic):
            await self.answer(self.client.publish(topic, payload))
            self.console.printLine(f"published on {topic}")
        else:
            reached = await self.answer(self.client.publishToMatching(topic, payload))
            self.console.printLine(describeReach(topic, [reached]))

    async def _publishRetained(self, topic, message=""):
        if not WILDCARDS.isdisjoint(topic):
            raise UsageError("a retained message needs a topic without + or #")
        payload = message.encode("utf-8", "surrogateescape")
        await self.answer(self.client.publish(topic, payload, retain=True))
        if payload:
            self.console.printLine(f"published and retained on {topic}")
        else:
            self.console.printLine(f"retained message of {topic} cleared")

    async def _list(self):
        for line in formatSubscriptions(await self.answer(self.client.listSubscriptions())):
            self.console.printLine(line)

    async def _topics(self, limit=None):
        if limit is not None:
            number = wholeNumber(limit, 18)
            if not number:
                raise UsageError(f"the limit must be a positive number, not {limit!r}")
            limit = number
        document = await self.answer(self.client.topics(limit))
        for line in formatTopics(document):
            self.console.printLine(line)

    async def _disconnect(self):
        await self._leave()

    async def _help(self):
        for line in helpLines():
            self.console.printLine(line)
