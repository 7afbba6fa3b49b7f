"""
How the C{dallal} command reads its arguments (L{dallal.cli.main.buildParser}).
"""

import pytest

from dallal.cli.main import buildParser


def parse(*arguments):
    return buildParser().parse_args(["127.0.0.1", "1373", *arguments])


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
