"""
The C{dallal} command (L{dallal.cli.main}) without a broker or a process:
how it reads its arguments (L{buildParser}), among them those of the topic
features and their help, and the pieces that stand between the broker and
a pipe: L{MessagePrinter} (C{subscribe}) and L{LinePublisher} (C{publish
-l}).
"""

import pytest
from twisted.internet.defer import Deferred

from dallal.cli import chat
from dallal.cli.main import LinePublisher, MessagePrinter, buildParser, main
from dallal.cli.shell import COMMANDS
from dallal.client import ReceivedMessage


def parse(*argv):
    return buildParser().parse_args(["127.0.0.1", "1373", *argv])


def refused(capsys, *argv):
    """
    What argparse says, on standard error, when it refuses C{argv}.
    """
    with pytest.raises(SystemExit) as exited:
        parse(*argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_publishRetain():
    args = parse("publish", "--retain", "a/x", "hello")
    assert (args.retain, args.to_matching, args.topic, args.message) == (
        True,
        False,
        "a/x",
        "hello",
    )


def test_publishToMatching():
    args = parse("publish", "--to-matching", "WEATHER/#", "storm")
    assert (args.retain, args.to_matching, args.topic) == (False, True, "WEATHER/#")


def test_publishPlainByDefault():
    args = parse("publish", "news", "hello")
    assert (args.retain, args.to_matching) == (False, False)


def test_publishRetainAndToMatchingExcludeEachOther(capsys):
    assert "argument --to-matching: not allowed with argument --retain" in refused(
        capsys, "publish", "--retain", "--to-matching", "a/#", "hi"
    )


def test_topicsOptions():
    args = parse("topics", "--limit", "5", "--json", "--timeout", "2")
    assert (args.limit, args.json, args.timeout) == (5, True, 2.0)
    args = parse("topics")
    assert (args.limit, args.json) == (None, False)


@pytest.mark.parametrize("limit", ["0", "-3", "lots"])
def test_topicsLimitMustBePositive(capsys, limit):
    assert "argument --limit" in refused(capsys, "topics", "--limit", limit)


def test_shellOverUdp():
    args = buildParser().parse_args(["--udp", "127.0.0.1", "1234", "shell", "--timeout", "3"])
    assert (args.udp, args.command, args.timeout) == (True, "shell", 3.0)


def test_chatName():
    args = parse("chat", "--name", "Anthony Narlock", "WEATHER/MN")
    assert (args.name, args.topic) == ("Anthony Narlock", "WEATHER/MN")
    assert parse("chat", "room").name is None


def test_defaultChatNameIsUserAtHost(monkeypatch):
    monkeypatch.setattr(chat.getpass, "getuser", lambda: "anthony")
    monkeypatch.setattr(chat.socket, "gethostname", lambda: "lab")
    assert chat.defaultName() == "anthony@lab"


def test_defaultChatNameWithoutAUser(monkeypatch):
    def noUser():
        raise KeyError("getpwuid(): uid not found: 4242")

    monkeypatch.setattr(chat.getpass, "getuser", noUser)
    monkeypatch.setattr(chat.socket, "gethostname", lambda: "lab")
    assert chat.defaultName() == "someone@lab"


@pytest.mark.parametrize(
    "topic, reason",
    [
        ("room/#", "'+' and '#' are reserved for subscription wildcards"),
        ("$SYS", "topics starting with '$' are reserved for the broker"),
    ],
)
def test_chatNeedsAPlainTopic(capsys, topic, reason):
    assert f"argument topic: {topic!r}: {reason}" in refused(capsys, "chat", topic)


def test_chatNameMustBePrintable(capsys):
    assert "argument --name: a name must be printable" in refused(
        capsys, "chat", "--name", "a\tb", "room"
    )


def help(capsys, *argv):
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_helpListsTheCommands(capsys):
    text = help(capsys)
    for command in ("publish", "subscribe", "stats", "topics", "shell", "chat"):
        assert f" {command} " in text


def test_publishHelp(capsys):
    text = help(capsys, "127.0.0.1", "1373", "publish")
    assert "--retain also keep it as the topic's retained message" in text
    assert "--to-matching the topic is a filter" in text
    assert "print on a second line how many it reached" in text


def test_topicsHelp(capsys):
    text = help(capsys, "127.0.0.1", "1373", "topics")
    assert "size of their retained message and their number of subscribers" in text
    assert "--limit N list at most N topics" in text


def test_shellHelpListsTheSlashCommands(capsys):
    text = help(capsys, "127.0.0.1", "1373", "shell")
    for command in COMMANDS.values():
        assert f"{command.usage} {command.summary}" in text


def test_chatHelp(capsys):
    text = help(capsys, "127.0.0.1", "1373", "chat")
    assert "published on the topic as '<name>: <line>'" in text
    assert "--name NAME the name your lines are signed with (default: user@host)" in text


# Arguments


@pytest.mark.parametrize(
    "arguments, topic, message",
    [
        (["publish", "weather", "-5C"], "weather", "-5C"),
        (["publish", "weather", "-5"], "weather", "-5"),
        (["publish", "--retain", "weather", "-x"], "weather", "-x"),
        (["publish", "weather", "--", "--retain"], "weather", "--retain"),
        (["publish", "weather", "--", "-l"], "weather", "-l"),
    ],
)
def test_messageBeginningWithADash(arguments, topic, message):
    args = parse(*arguments)
    assert (args.topic, args.message) == (topic, message)


@pytest.mark.parametrize(
    "arguments, stdinLine, file",
    [
        (["publish", "-l", "log"], True, None),
        (["publish", "log", "-l"], True, None),
        (["publish", "-f", "notice.txt", "log"], False, "notice.txt"),
    ],
)
def test_optionsOfPublishAreStillOptions(arguments, stdinLine, file):
    args = parse(*arguments)
    assert (args.topic, args.message, args.stdin_line, args.file) == ("log", None, stdinLine, file)


def test_anUnknownLongOptionIsRefused(capsys):
    with pytest.raises(SystemExit):
        parse("publish", "--retian", "news", "hello")
    assert "unrecognized arguments: --retian" in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, error",
    [
        (
            ["publish", "--count", "2", "--every", "inf", "t", "m"],
            "argument --every: must be a number, positive or 0, not 'inf'",
        ),
        (
            ["publish", "--count", "2", "--every", "-1", "t", "m"],
            "argument --every: must be a number, positive or 0, not '-1'",
        ),
        (
            ["publish", "--count", "0", "t", "m"],
            "argument --count: must be a whole number of at least 1, not '0'",
        ),
        (
            ["publish", "--count", "x", "t", "m"],
            "argument --count: must be a whole number of at least 1, not 'x'",
        ),
        (
            ["stats", "--timeout", "nan"],
            "argument --timeout: must be a number, positive, not 'nan'",
        ),
    ],
)
def test_badNumbersAreRefusedInOneLine(arguments, error, capsys):
    """
    A number out of its option's bounds (an endless C{--every} included,
    which would never publish the second message) stops the command with
    one line naming the option.
    """
    with pytest.raises(SystemExit):
        parse(*arguments)
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].endswith(error)
    assert "Traceback" not in "\n".join(lines)


def test_everyZeroIsTaken():
    assert parse("publish", "--count", "2", "--every", "0", "t", "m").every == 0


def test_aPortOutOfRangeIsRefused(capsys):
    with pytest.raises(SystemExit):
        buildParser().parse_args(["127.0.0.1", "65536", "stats"])
    assert "argument port: must be a whole number from 1 to 65535, not '65536'" in (
        capsys.readouterr().err
    )


# Pipes


def message(payload):
    return ReceivedMessage("news", payload, 1, False, {}, False)


class ClosedOutput:
    """
    Standard output whose reader is gone.
    """

    def write(self, data):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        pass


def test_aMessageThatCannotBePrintedIsNeverAcked():
    printer = MessagePrinter(ClosedOutput())
    printer.release()
    handled = printer(message(b"lost"))
    assert isinstance(handled, Deferred) and not handled.called
    assert printer.outputGone.called


def test_aHeldMessageThatCannotBePrintedIsNeverAcked():
    printer = MessagePrinter(ClosedOutput())
    handled = printer(message(b"held"))
    printer.release()
    assert not handled.called
    assert printer.outputGone.called


class FakeConsole:
    """
    A pipe console: it can be paused, and records whether it is.
    """

    interactive = False

    def __init__(self):
        self.paused = False

    def pauseProducing(self):
        self.paused = True

    def resumeProducing(self):
        self.paused = False


class Broker:
    """
    The publishes sent, each waiting for its answer.
    """

    def __init__(self):
        self.sent = []

    def publish(self, payload):
        acked = Deferred()
        self.sent.append((payload, acked))
        return acked

    def ack(self, count=1):
        for _ in range(count):
            payload, acked = self.sent.pop(0)
            acked.callback(None)


def test_linesArePublishedAsTheyAreRead():
    console, broker = FakeConsole(), Broker()
    publisher = LinePublisher(console, broker.publish)
    for line in ["a", "", "b\udcff"]:
        publisher.lineReceived(line)
    assert [payload for payload, _ in broker.sent] == [b"a", b"b\xff"]
    publisher.inputEnded()
    assert not publisher.finished.called
    broker.ack(2)
    assert publisher.finished.result == [None, None]


def test_readingWaitsWhileTheWindowIsFull():
    console, broker = FakeConsole(), Broker()
    publisher = LinePublisher(console, broker.publish, window=3)
    for line in ["a", "b"]:
        publisher.lineReceived(line)
    assert not console.paused
    publisher.lineReceived("c")
    assert console.paused
    broker.ack()
    assert not console.paused


def test_theFirstFailureEndsIt():
    console, broker = FakeConsole(), Broker()
    publisher = LinePublisher(console, broker.publish)
    publisher.lineReceived("a")
    publisher.lineReceived("b")
    broker.sent[0][1].errback(ValueError("refused"))
    failures = []
    publisher.finished.addErrback(failures.append)
    assert failures[0].check(ValueError)
    publisher.lineReceived("c")
    assert len(broker.sent) == 2
