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
