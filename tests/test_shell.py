"""
The interactive commands without processes: L{dallal.cli.shell.Shell} and
L{dallal.cli.chat.Chat} driving a real client over an in-memory transport, with
the broker's answers typed in by the tests and what a user would see
recorded; and the consoles, the terminal one rendered on a terminal
emulator.
"""

import io

import pytest
from twisted.conch.insults.helper import TerminalBuffer
from twisted.conch.insults.insults import ClientProtocol, ServerProtocol
from twisted.internet.error import ConnectionDone
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.python.failure import Failure

from dallal.cli.chat import Chat, checkNickname
from dallal.cli.console import PipeConsole, TerminalConsole, displayable
from dallal.cli.shell import (
    COMMANDS,
    Shell,
    UsageError,
    describeReach,
    formatSubscriptions,
    formatTopics,
    parseCommand,
)
from dallal.client import DallalClientProtocol

TIMEOUT = 10.0


class RecordingConsole:
    """
    A console that keeps what it was asked to print, as the lines a user
    would read.
    """

    interactive = False

    def __init__(self):
        self.lines = []

    def printLine(self, text):
        self.lines.append(text)

    def printError(self, text):
        self.lines.append(f"error: {text}")

    def printMessage(self, prefix, payload):
        self.lines.append(prefix + payload.decode("utf-8"))

    def taken(self):
        """
        The lines printed since the last call.
        """
        lines, self.lines = self.lines, []
        return lines


class Session:
    """
    A L{Shell} or L{Chat} on a real client whose transport is a
    L{StringTransport}, on a L{Clock}.
    """

    def __init__(self, makeSession):
        self.clock = Clock()
        self.client = DallalClientProtocol()
        self.transport = StringTransport()
        self.client.makeConnection(self.transport)
        self.console = RecordingConsole()
        self.session = makeSession(self.clock, self.client, self.console, TIMEOUT, self.client.bye)
        self.status = []
        self.session.finished.addCallback(self.status.append)

    def type(self, *lines):
        for line in lines:
            self.session.lineReceived(line)

    def sent(self):
        """
        What the client wrote to the broker since the last call.
        """
        written = self.transport.value()
        self.transport.clear()
        return written

    def answer(self, data):
        self.client.dataReceived(data)

    def brokerCloses(self):
        self.client.connectionLost(Failure(ConnectionDone()))


@pytest.fixture
def shell():
    session = Session(Shell)
    session.session.start()
    return session


# Commands as typed.


@pytest.mark.parametrize(
    "line, name, arguments",
    [
        ("/sub a/+", "/sub", ["a/+"]),
        ("/SUB a/# all", "/sub", ["a/#", "all"]),
        ("  /pub news   hello   world  ", "/pub", ["news", "hello   world  "]),
        ("/pub\tnews\thi", "/pub", ["news", "hi"]),
        ("/pubr news", "/pubr", ["news"]),
        ("/topics 5", "/topics", ["5"]),
        ("/list", "/list", []),
    ],
)
def test_parseCommand(line, name, arguments):
    assert parseCommand(line) == (COMMANDS[name], arguments)


def test_parseBlankLine():
    assert parseCommand("   ") is None


@pytest.mark.parametrize(
    "line, error",
    [
        ("hello", "commands start with /, as in /pub news hello; /help lists them"),
        ("/quit", "unknown command /quit; /help lists the commands"),
        ("/sub", "usage: /sub <filter> [latest|all|fire]"),
        ("/sub a b c", "usage: /sub <filter> [latest|all|fire]"),
        ("/pub news", "usage: /pub <topic> <message...>"),
        ("/unsub", "usage: /unsub <filter>"),
        ("/list all", "usage: /list"),
    ],
)
def test_parseCommandRefuses(line, error):
    with pytest.raises(UsageError) as raised:
        parseCommand(line)
    assert str(raised.value) == error


# The shell and the broker.


def test_subscribeThenMessages(shell):
    shell.type("/sub a/+")
    assert shell.sent() == b"SUB 1 a/+\r\n"
    assert shell.console.taken() == []
    shell.answer(b"SUBACK 1\r\nMSG a/x 5 sub=1 seq=1 id=1 retained=1\r\nhello\r\n")
    assert shell.console.taken() == ["subscribed to a/+", "a/x: hello"]
    # Acked once printed.
    assert shell.sent() == b"ACK 1\r\n"


def test_subscribeWithMode(shell):
    shell.type("/sub news all")
    assert shell.sent() == b"SUB 1 news mode=all\r\n"


def test_unknownModeIsAUsageError(shell):
    shell.type("/sub news often")
    assert shell.sent() == b""
    assert shell.console.taken() == [
        "error: no mode 'often'; usage: /sub <filter> [latest|all|fire]"
    ]


def test_commandsRunOneAtATime(shell):
    """
    A command is sent once the one before it is answered, so that what is
    printed follows the order of the commands, local errors included.
    """
    shell.type("/sub a", "/bogus", "/list")
    assert shell.sent() == b"SUB 1 a\r\n"
    assert shell.console.taken() == []
    shell.answer(b"SUBACK 1\r\n")
    assert shell.sent() == b"LIST 2\r\n"
    assert shell.console.taken() == [
        "subscribed to a",
        "error: unknown command /bogus; /help lists the commands",
    ]
    document = b'{"count": 1, "subscriptions": [{"filter": "a", "mode": "latest"}]}'
    shell.answer(b"LIST 2 %d\r\n%s\r\n" % (len(document), document))
    assert shell.console.taken() == ["1 subscription:", "  a (latest)"]


def test_serverErrorIsOneLineAndTheShellGoesOn(shell):
    shell.type("/unsub zz", "/unsub a")
    shell.answer(b"ERR 1 NOT_SUBSCRIBED not subscribed to 'zz'\r\n")
    assert shell.console.taken() == ["error: not subscribed to 'zz' (NOT_SUBSCRIBED)"]
    assert shell.sent() == b"UNSUB 1 zz\r\nUNSUB 2 a\r\n"
    shell.answer(b"UNSUBACK 2\r\n")
    assert shell.console.taken() == ["unsubscribed from a"]


def test_unansweredCommandTimesOut(shell):
    shell.type("/list", "/topics")
    shell.clock.advance(TIMEOUT - 0.5)
    assert shell.console.taken() == []
    shell.clock.advance(0.5)
    assert shell.console.taken() == ["error: no answer from the broker within 10 seconds"]
    assert shell.sent() == b"LIST 1\r\nTOPICS 2\r\n"


def test_publish(shell):
    shell.type("/pub news hello  world")
    assert shell.sent() == b"PUB 1 news 12\r\nhello  world\r\n"
    shell.answer(b"PUBACK 1\r\n")
    assert shell.console.taken() == ["published on news"]


@pytest.mark.parametrize(
    "answer, printed",
    [
        (b"PUBACK 1 topics=3\r\n", "published on 3 topics"),
        (b"PUBACK 1 topics=1\r\n", "published on 1 topic"),
        (b"PUBACK 1 topics=0\r\n", "no topic matches WEATHER/#"),
    ],
)
def test_publishWithWildcardGoesToEveryMatchingTopic(shell, answer, printed):
    shell.type("/pub WEATHER/# storm")
    assert shell.sent() == b"PUB 1 WEATHER/# 5 to-matching=1\r\nstorm\r\n"
    shell.answer(answer)
    assert shell.console.taken() == [printed]


def test_publishRetained(shell):
    shell.type("/pubr news kept", "/pubr news")
    assert shell.sent() == b"PUB 1 news 4 retain=1\r\nkept\r\n"
    shell.answer(b"PUBACK 1\r\n")
    assert shell.sent() == b"PUB 2 news 0 retain=1\r\n\r\n"
    shell.answer(b"PUBACK 2\r\n")
    assert shell.console.taken() == [
        "published and retained on news",
        "retained message of news cleared",
    ]


def test_publishRetainedRefusesAFilter(shell):
    shell.type("/pubr news/# kept")
    assert shell.sent() == b""
    assert shell.console.taken() == ["error: a retained message needs a topic without + or #"]


def test_topics(shell):
    shell.type("/topics 2")
    assert shell.sent() == b"TOPICS 1 limit=2\r\n"
    document = (
        b'{"topics": [{"retained_bytes": null, "subscribers": 2, "topic": "a/+"},'
        b' {"retained_bytes": 1, "subscribers": 0, "topic": "a/x"}],'
        b' "total": 3, "truncated": true}'
    )
    shell.answer(b"TOPICS 1 %d\r\n%s\r\n" % (len(document), document))
    assert shell.console.taken() == [
        "TOPIC  RETAINED  SUBSCRIBERS",
        "a/+    -         2",
        "a/x    1 byte    0",
        "(showing 2 of 3 topics)",
    ]


@pytest.mark.parametrize("limit", ["0", "-1", "many"])
def test_topicsLimitMustBePositive(shell, limit):
    shell.type(f"/topics {limit}")
    assert shell.sent() == b""
    assert shell.console.taken() == [f"error: the limit must be a positive number, not {limit!r}"]


def test_help(shell):
    shell.type("/help")
    lines = shell.console.taken()
    assert [line.split()[0] for line in lines] == list(COMMANDS)
    assert (
        lines[0] == "/sub <filter> [latest|all|fire]  subscribe; + matches one level, # all below"
    )


def test_disconnectSaysByeAndFinishes(shell):
    shell.type("/disc", "/list")
    assert shell.sent() == b"BYE\r\n"
    assert shell.status == []
    shell.answer(b"BYE\r\n")
    shell.brokerCloses()
    assert shell.console.taken() == ["disconnected"]
    assert shell.status == [0]
    assert shell.sent() == b""


def test_endOfInputWaitsForTheRunningCommand(shell):
    shell.type("/sub a")
    shell.session.inputEnded()
    assert shell.sent() == b"SUB 1 a\r\n"
    shell.answer(b"SUBACK 1\r\n")
    assert shell.sent() == b"BYE\r\n"
    shell.brokerCloses()
    assert shell.console.taken() == ["subscribed to a", "disconnected"]
    assert shell.status == [0]


def test_unansweredByeClosesAndFails(shell):
    shell.type("/disc")
    shell.clock.advance(TIMEOUT)
    assert shell.transport.disconnecting
    assert shell.console.taken() == ["error: the broker did not answer BYE within 10 seconds"]
    assert shell.status == [1]


def test_brokerGoneIsReportedOnce(shell):
    shell.type("/list")
    shell.brokerCloses()
    assert shell.console.taken() == ["error: the broker closed the connection"]
    assert shell.status == [1]
    shell.type("/list")
    assert shell.console.taken() == []


def test_interruptedFinishesQuietly(shell):
    """
    Stopped by a signal, the session ends with status 0, and the connection
    the reactor then closes is not reported as lost.
    """
    shell.type("/list")
    shell.session.interrupted()
    shell.brokerCloses()
    assert shell.status == [0]
    assert shell.console.taken() == []


def test_greetingOnATerminalOnly():
    session = Session(Shell)
    session.console.interactive = True
    session.session.start()
    assert session.console.taken() == ["connected; /help lists the commands"]


# What the commands print.


def test_formatTopicsWithoutTopics():
    assert formatTopics({"topics": [], "total": 0, "truncated": False}) == ["no topics"]


def test_formatTopicsAllLeftOut():
    assert formatTopics({"topics": [], "total": 4, "truncated": True}) == [
        "(showing 0 of 4 topics)"
    ]


def test_formatSubscriptionsWithoutSubscriptions():
    assert formatSubscriptions({"count": 0, "subscriptions": []}) == ["no subscriptions"]


@pytest.mark.parametrize(
    "counts, text",
    [
        ([2, 2, 2], "published on 2 topics"),
        ([1, 3], "published on 1 to 3 topics"),
        ([0, 2], "published on 0 to 2 topics"),
        ([0], "no topic matches a/#"),
    ],
)
def test_describeReach(counts, text):
    assert describeReach("a/#", counts) == text


# The chat.


@pytest.fixture
def chat():
    session = Session(
        lambda clock, client, console, timeout, sayBye: Chat(
            clock, client, console, timeout, sayBye, "room", "alice"
        )
    )
    session.session.start()
    return session


def joined(chat):
    assert chat.sent() == b"SUB 1 room mode=all\r\n"
    chat.answer(b"SUBACK 1\r\n")
    assert chat.console.taken() == ["chatting on room as alice"]


def test_chatLinesWaitUntilJoined(chat):
    chat.type("hello")
    joined(chat)
    assert chat.sent() == b"PUB 2 room 12\r\nalice: hello\r\n"


def test_chatShowsOthersButNotItsOwnLines(chat):
    joined(chat)
    chat.type("hello")
    chat.answer(
        b"MSG room 12 sub=1 seq=1 id=1\r\nalice: hello\r\n"
        b"PUBACK 2\r\n"
        b"MSG room 7 sub=1 seq=2 id=2\r\nbob: hi\r\n"
    )
    assert chat.console.taken() == ["bob: hi"]


def test_chatShowsTheSameLineFromSomeoneElse(chat):
    """
    Only as many copies of a line as were sent are skipped.
    """
    joined(chat)
    chat.type("hello")
    chat.answer(
        b"PUBACK 2\r\n"
        b"MSG room 12 sub=1 seq=1 id=1\r\nalice: hello\r\n"
        b"MSG room 12 sub=1 seq=2 id=2\r\nalice: hello\r\n"
    )
    assert chat.console.taken() == ["alice: hello"]


def test_chatRefusedLineIsNotAwaitedBack(chat):
    joined(chat)
    chat.type("x" * 5)
    chat.answer(b"ERR 2 PAYLOAD_TOO_LARGE too large\r\n")
    chat.answer(b"MSG room 12 sub=1 seq=1 id=1\r\nalice: xxxxx\r\n")
    assert chat.console.taken() == ["error: too large (PAYLOAD_TOO_LARGE)", "alice: xxxxx"]


def test_chatSkipsBlankLines(chat):
    joined(chat)
    chat.type("", "   ")
    assert chat.sent() == b""


def test_chatThatCannotJoinFinishes(chat):
    chat.answer(b"ERR 1 BAD_TOPIC nope\r\n")
    assert chat.console.taken() == ["error: nope (BAD_TOPIC)"]
    assert chat.transport.disconnecting
    chat.brokerCloses()
    assert chat.status == [1]


@pytest.mark.parametrize("name", ["", "  ", "a\nb", "bell\a"])
def test_checkNameRefuses(name):
    with pytest.raises(ValueError):
        checkNickname(name)


# The consoles.


class Handler:
    def __init__(self):
        self.lines = []
        self.ended = 0

    def lineReceived(self, line):
        self.lines.append(line)

    def inputEnded(self):
        self.ended += 1


def test_pipeConsole():
    errors = io.StringIO()
    console = PipeConsole(errors)
    console.handler = handler = Handler()
    transport = StringTransport()
    console.makeConnection(transport)
    console.dataReceived(b"/sub a\r\n/pub a caf\xc3\xa9\n/pub a \xff\n")
    # Bytes that are not UTF-8 survive the round trip to the payload.
    assert handler.lines == ["/sub a", "/pub a café", "/pub a \udcff"]
    assert handler.lines[2].encode("utf-8", "surrogateescape") == b"/pub a \xff"
    console.printLine("subscribed to a")
    console.printMessage("a: ", b"\x1b[2J\xff")
    console.printError("oops")
    assert transport.value() == b"subscribed to a\na: \x1b[2J\xff\n"
    assert errors.getvalue() == "error: oops\n"
    console.readConnectionLost()
    assert handler.ended == 1
    closed = console.close()
    assert transport.disconnecting and not closed.called
    console.connectionLost(Failure(ConnectionDone()))
    assert closed.called


def test_pipeConsoleLineTooLong():
    errors = io.StringIO()
    console = PipeConsole(errors)
    console.MAX_LENGTH = 8
    console.handler = handler = Handler()
    transport = StringTransport()
    console.makeConnection(transport)
    console.dataReceived(b"/list\n/pub a 12345\n/list\n")
    console.dataReceived(b"/list\n")
    assert handler.lines == ["/list"]
    assert handler.ended == 1
    assert transport.producerState == "paused"
    assert errors.getvalue() == "error: a line longer than 8 bytes: reading stops here\n"


def test_pipeConsoleOutputGone():
    """
    When nobody reads standard output any more, the input ends and closing
    has nothing to wait for.
    """
    console = PipeConsole(io.StringIO())
    console.handler = handler = Handler()
    console.makeConnection(StringTransport())
    console.writeConnectionLost()
    assert handler.ended == 1
    assert console.close().called


def test_displayable():
    assert displayable(b"caf\xc3\xa9\r\nline\ttab\x1b[2J\x07\xff") == (
        "café\nline\ttab\\x1b[2J\\x07\ufffd"
    )


class Terminal:
    """
    A L{TerminalConsole} behind insults' L{ServerProtocol}, whose output a
    terminal emulator renders.
    """

    def __init__(self, columns=80):
        self.handler = Handler()
        self.console = TerminalConsole("> ", lambda: columns)
        self.console.handler = self.handler
        self.server = ServerProtocol(lambda: self.console)
        self.output = StringTransport()
        self.server.makeConnection(self.output)
        self.screen = ClientProtocol(lambda: TerminalBuffer())
        self.screen.makeConnection(StringTransport())
        self.screen.terminal.width = columns
        self.screen.terminal.reset()

    def press(self, keys):
        self.server.dataReceived(keys)

    def rows(self):
        """
        The screen's non-blank rows, after rendering what was written.
        """
        self.screen.dataReceived(self.output.value())
        self.output.clear()
        return [row for row in bytes(self.screen.terminal).decode().split("\n") if row]

    def cursor(self):
        return self.screen.terminal.x, self.screen.terminal.y


def test_terminalLinePrintedAboveTheInput():
    """
    A line printed while one is half typed appears on its own row, and the
    prompt and the partial input are drawn again below it, the cursor where
    it was in the input.
    """
    terminal = Terminal()
    terminal.press(b"/pub news hel")
    assert terminal.rows() == ["> /pub news hel"]
    terminal.console.printMessage("news: ", b"from someone")
    assert terminal.rows() == ["news: from someone", "> /pub news hel"]
    assert terminal.cursor() == (len("> /pub news hel"), 1)
    terminal.press(b"\x1b[D\x1b[D")
    terminal.console.printLine("second")
    assert terminal.rows() == ["news: from someone", "second", "> /pub news hel"]
    assert terminal.cursor() == (len("> /pub news h"), 2)
    terminal.press(b"\x1b[C\x1b[Clo\r")
    assert terminal.handler.lines == ["/pub news hello"]
    assert terminal.rows() == ["news: from someone", "second", "> /pub news hello", "> "]


def test_terminalWrappedInputIsErasedWhole():
    terminal = Terminal(columns=10)
    terminal.press(b"0123456789abc")
    assert terminal.rows() == ["> 01234567", "89abc"]
    terminal.console.printLine("note")
    assert terminal.rows() == ["note", "> 01234567", "89abc"]


def test_terminalInputFillingARowExactly():
    """
    Input that fills its row leaves the cursor on that row, not the next.
    """
    terminal = Terminal(columns=10)
    terminal.console.printLine("first")
    terminal.press(b"01234567")
    terminal.console.printLine("note")
    assert terminal.rows() == ["first", "note", "> 01234567"]


def test_terminalInsertsInTheMiddle():
    terminal = Terminal()
    terminal.press(b"/pub a c\x1b[Db\r")
    assert terminal.handler.lines == ["/pub a bc"]
    assert terminal.rows() == ["> /pub a bc", "> "]


def test_terminalTakesUtf8():
    terminal = Terminal()
    terminal.press("/pub a é€".encode()[:-1])
    terminal.press("€".encode()[-1:] + b"\r")
    assert terminal.handler.lines == ["/pub a é€"]


def test_terminalIgnoresControlCharacters():
    terminal = Terminal()
    terminal.press(b"a\tb\x0bc\x1b[15~\r")
    assert terminal.handler.lines == ["abc"]


def test_terminalHistory():
    terminal = Terminal()
    terminal.press(b"/list\r\x1b[A\r")
    assert terminal.handler.lines == ["/list", "/list"]


@pytest.mark.parametrize("key", [b"\x04", b"\x03"])
def test_terminalEndOfInput(key):
    """
    Ctrl-D on an empty line, or Ctrl-C, ends the input once; keys after it
    do nothing.
    """
    terminal = Terminal()
    terminal.press(key + b"/list\r" + key)
    assert terminal.handler.ended == 1
    assert terminal.handler.lines == []


def test_terminalCtrlDDeletesInALine():
    terminal = Terminal()
    terminal.press(b"ab\x01\x04\r")
    assert terminal.handler.lines == ["b"]
    assert terminal.handler.ended == 0


def test_terminalCloseErasesThePrompt():
    terminal = Terminal()
    terminal.console.printLine("disconnected")
    terminal.press(b"typed")
    closed = terminal.console.close()
    assert terminal.rows() == ["disconnected"]
    assert terminal.cursor() == (0, 1)
    assert terminal.output.disconnecting and not closed.called
    terminal.server.connectionLost(Failure(ConnectionDone()))
    assert closed.called
