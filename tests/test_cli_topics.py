"""
The command line of the topic features, parsed: C{publish --retain} and
C{--to-matching}, C{topics}, C{shell} and C{chat}, and their help.
"""

import pytest

from dallal.cli import chat
from dallal.cli.main import buildParser, main
from dallal.cli.shell import COMMANDS


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
