"""
C{twistd dallal --config FILE}: every option a key of a TOML file, the
command line over it, and one line naming the key for anything wrong.
"""

import re

import pytest
from helpers import REPO
from twisted.python import usage

from dallal.server.config import NOT_KEYS, ConfigError
from dallal.server.tap import Options


def parsed(tmp_path, text, *argv):
    """
    L{Options} parsed from C{argv} and a configuration file of C{text}.
    """
    path = tmp_path / "dallal.toml"
    path.write_text(text)
    options = Options()
    options.parseWithConfig(["--config", str(path), *argv])
    return options


def refusal(tmp_path, text, *argv):
    """
    The one line a wrong configuration file stops twistd with, the file's
    name in it shortened to C{dallal.toml}.
    """
    with pytest.raises(ConfigError) as raised:
        parsed(tmp_path, text, *argv)
    message = str(raised.value)
    assert "\n" not in message
    return message.replace(str(tmp_path / "dallal.toml"), "dallal.toml")


def test_eachKindOfOptionHasAKey(tmp_path):
    options = parsed(
        tmp_path,
        'max-queued = 5\nack-timeout = 2.5\ndata-dir = "store"\nmessage-events = true\n'
        'tcp = ["0", "tcp:0:interface=127.0.0.1"]\n'
        'bridge = ["hub=tcp:127.0.0.1:1"]\n',
    )
    assert options["max-queued"] == 5
    assert options["ack-timeout"] == 2.5
    assert options["data-dir"] == "store"
    assert options["message-events"]
    assert options["tcp"] == ["tcp:0:interface=127.0.0.1", "tcp:0:interface=127.0.0.1"]
    assert [bridge.name for bridge in options["bridge"]] == ["hub"]


def test_aRepeatableOptionTakesOneValueToo(tmp_path):
    assert parsed(tmp_path, 'tcp = "1400"\n')["tcp"] == ["tcp:1400:interface=127.0.0.1"]


def test_aFlagSetFalseStaysOff(tmp_path):
    assert not parsed(tmp_path, "message-events = false\n")["message-events"]


def test_theCommandLineOverridesTheFile(tmp_path):
    options = parsed(
        tmp_path,
        'max-queued = 5\nmax-payload = 100\ntcp = ["1400", "1401"]\n',
        "--max-queued",
        "7",
        "--tcp",
        "1500",
    )
    assert options["max-queued"] == 7
    assert options["max-payload"] == 100
    assert options["tcp"] == ["tcp:1500:interface=127.0.0.1"]


def test_aMissingFile(tmp_path):
    missing = tmp_path / "missing.toml"
    with pytest.raises(ConfigError) as raised:
        Options().parseWithConfig(["--config", str(missing)])
    assert str(raised.value) == f"{missing}: cannot read it: No such file or directory"


def test_notToml(tmp_path):
    assert refusal(tmp_path, "max-queued 5\n").startswith("dallal.toml: not valid TOML: ")


def test_anUnknownKeyIsNamedWithTheClosestOption(tmp_path):
    assert (
        refusal(tmp_path, "max-queue = 5\n")
        == "dallal.toml: unknown key 'max-queue' (did you mean 'max-queued'?)"
    )


def test_anUnknownKeyLikeNoOption(tmp_path):
    assert refusal(tmp_path, "colour = 5\n") == "dallal.toml: unknown key 'colour'"


@pytest.mark.parametrize("name", sorted(NOT_KEYS))
def test_optionsThatAreNotSettingsAreNoKeys(tmp_path, name):
    assert refusal(tmp_path, f"{name} = true\n").startswith(f"dallal.toml: unknown key {name!r}")


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            'max-queued = "x"',
            "dallal.toml: max-queued must be a whole number of at least 1, not 'x'",
        ),
        ("max-queued = 0", "dallal.toml: max-queued must be a whole number of at least 1, not '0'"),
        ("ack-timeout = -1", "dallal.toml: ack-timeout must be a number, positive, not '-1'"),
        (
            'sys-interval = "soon"',
            "dallal.toml: sys-interval must be a number, positive or 0, not 'soon'",
        ),
        ("udp = 70000", "dallal.toml: udp must be a whole number from 0 to 65535, not '70000'"),
        ("max-queued = true", "dallal.toml: max-queued takes a string or a number, not true"),
        ("max-queued = [1, 2]", "dallal.toml: max-queued takes a string or a number, not a list"),
        ("max-queued = {a = 1}", "dallal.toml: max-queued takes a string or a number, not a table"),
        ("tcp = [true]", "dallal.toml: tcp takes a string or a number, not true"),
        ("message-events = 1", "dallal.toml: message-events is a flag: true or false, not 1"),
        (
            'message-events = "yes"',
            "dallal.toml: message-events is a flag: true or false, not 'yes'",
        ),
        # Values checked once all options are read.
        ('tcp = ["70000"]', "dallal.toml: tcp must be a whole number from 0 to 65535, not '70000'"),
        ('name = "a b"', "dallal.toml: name: "),
        ('bridge = ["nothing"]', "dallal.toml: bridge "),
        (
            'slow-consumer = "wait"',
            "dallal.toml: slow-consumer must be one of drop-oldest, disconnect, not 'wait'",
        ),
    ],
)
def test_aBadValueIsOneLineNamingTheKey(tmp_path, text, expected):
    assert refusal(tmp_path, text + "\n").startswith(expected)


@pytest.mark.parametrize(
    "text, argv, expected",
    [
        ("max-queued = 5", ["--slow-consumer", "wait"], "^--slow-consumer must be one of"),
        # An option whose name starts with a key of the file's.
        ("max-queued = 5", ["--max-queued-bytes", "x"], "^--max-queued-bytes must be"),
        ('slow-consumer = "drop-oldest"', ["--slow-consumer", "wait"], "^--slow-consumer"),
    ],
)
def test_aBadCommandLineValueIsTheCommandLines(tmp_path, text, argv, expected):
    with pytest.raises(usage.UsageError, match=expected):
        parsed(tmp_path, text + "\n", *argv)


def test_twistdStopsWithTheLine(tmp_path):
    path = tmp_path / "dallal.toml"
    path.write_text("max-queue = 5\n")
    with pytest.raises(SystemExit) as stopped:
        Options().parseOptions(["--config", str(path)])
    assert str(stopped.value) == (
        f"dallal: cannot start: {path}: unknown key 'max-queue' (did you mean 'max-queued'?)"
    )


def readmeExample():
    """
    The example configuration file of README.md's "Configuration".
    """
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Configuration") :]
    return re.search(r"```toml\n(.*?)```", section, re.DOTALL).group(1)


def test_theReadmeExampleParsesAndHasEveryOption(tmp_path):
    """
    The example sets some keys and shows the others commented out: it
    parses either way, and names every option, so that README.md says what
    a new option's key is.
    """
    text = readmeExample()
    parsed(tmp_path, text)
    uncommented = re.sub(r"^# ([a-z-]+ = )", r"\1", text, flags=re.MULTILINE)
    options = parsed(tmp_path, uncommented)
    keys = set(re.findall(r"^([a-z-]+) = ", uncommented, re.MULTILINE))
    everyOption = {entry.rstrip("=") for entry in options.longOpt} - NOT_KEYS
    assert keys == everyOption, everyOption ^ keys
