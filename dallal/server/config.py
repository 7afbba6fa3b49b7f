"""
C{twistd dallal --config FILE}: the command line's options in a TOML file.

Every long option of C{twistd dallal} is a key of the file, named as the
option: a parameter takes a string or a number (C{max-queued = 1000}), a
flag C{true} or C{false} (C{message-events = true}), and an option that may
be repeated (an C{opt_} method taking a value, such as C{--tcp}) a list
(C{tcp = ["1373", "ssl:8883:..."]}) or a single value.  The keys are read
from the L{usage.Options} themselves, and each value goes through the same
converter as on the command line, so an option added to the options is a
key of the file at once.

The command line overrides the file: an option given on it leaves the
file's value of that key unused (a repeated one replaces the file's list).
"""

import difflib
import getopt
import re
import tomllib

from twisted.python import usage

# The options that are not settings of the broker: --config itself, and
# those every usage.Options has.
NOT_KEYS = frozenset({"config", "help", "version"})


class ConfigError(Exception):
    """
    The configuration file cannot be read, or a key or value of it is
    wrong: the message is one line, naming the file and the key.
    """


def settingNames(options):
    """
    The keys a configuration file may have for C{options}.

    @return: option name -> C{True} if it takes a value, C{False} for a flag.
    """
    keys = {}
    for entry in options.longOpt:
        name = entry.rstrip("=")
        if name not in NOT_KEYS and options.synonyms.get(name) == name:
            keys[name] = entry.endswith("=")
    return keys


def _repeatable(options, name):
    # An optParameter keeps one value; an opt_ method taking one may be
    # given again.
    return not isinstance(options._dispatch[name], usage.CoerceParameter)


def commandLineNames(options, argv):
    """
    The long names of the options C{argv} gives, whatever the spelling
    (a short option, a synonym), and the value of C{--config} if given.

    @return: C{(names, configPath)}; C{(set(), None)} when C{argv} is not
        valid (its parsing will say why).
    """
    try:
        given, _ = getopt.getopt(argv, options.shortOpt, options.longOpt)
    except getopt.error:
        return set(), None
    names, configPath = set(), None
    for option, value in given:
        name = option.lstrip("-")
        name = options.synonyms.get(name, options.synonyms.get(name.replace("-", "_"), name))
        names.add(name)
        if name == "config":
            configPath = value
    return names, configPath


def readConfig(path):
    """
    The keys and values of a TOML file.

    @raise ConfigError: it cannot be read, or it is not TOML.
    """
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except OSError as error:
        raise ConfigError(f"{path}: cannot read it: {error.strerror}") from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not valid TOML: {error}") from error


def _text(value):
    """
    A TOML value as the command line would give it.
    """
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError
    return str(value)


def _describe(value):
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "a list"
    return repr(value)


def applyConfig(options, path, table, skip=frozenset()):
    """
    Give C{options} the values of a configuration file, through the
    handlers and converters of their command-line options.

    @param table: the file's keys and values (L{readConfig}).
    @param skip: the option names whose value the command line gives.
    @return: the names of the options the file set.
    @raise ConfigError: a key is unknown, or a value is wrong.
    """
    keys = settingNames(options)
    for name in table:
        if name not in keys:
            close = difflib.get_close_matches(name, keys, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: unknown key {name!r}{hint}")
    applied = set()
    for name, value in table.items():
        if name in skip:
            continue
        if keys[name]:
            values = value if isinstance(value, list) and _repeatable(options, name) else [value]
            for each in values:
                try:
                    text = _text(each)
                except ValueError:
                    raise ConfigError(
                        f"{path}: {name} takes a string or a number, not {_describe(each)}"
                    ) from None
                _dispatch(options, path, name, text)
        elif not isinstance(value, bool):
            raise ConfigError(f"{path}: {name} is a flag: true or false, not {_describe(value)}")
        elif value:
            _dispatch(options, path, name, None)
        applied.add(name)
    return applied


def _dispatch(options, path, name, text):
    handler = options._dispatch[name]
    try:
        if isinstance(handler, usage.CoerceParameter):
            options.opts[name] = handler.coerce(text)
        else:
            handler(name, text)
    except (usage.UsageError, ValueError) as error:
        raise ConfigError(inFile(path, name, str(error))) from error


def aboutOption(message, name):
    """
    Whether an error message is about the option C{--name} (and not about
    a longer one that starts alike, C{--max-queued-bytes} for C{max-queued}).
    """
    return re.match(rf"--{re.escape(name)}(?![\w-])", message) is not None


def inFile(path, name, message):
    """
    An error about an option, said of the key of the configuration file
    that gave its value: C{--max-queued must be ...} becomes
    C{dallal.toml: max-queued must be ...}.
    """
    if aboutOption(message, name):
        return f"{path}: {name}{message[len(name) + 2 :]}"
    return f"{path}: {name}: {message}"
