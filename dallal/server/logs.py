"""
The broker's log file, rotated as the operator says: a log observer
factory for twistd's C{--logger} option.

twistd's own C{--logfile} rotates at 1 MB and keeps every rotated file for
ever; with C{--message-events} a busy broker fills a megabyte in seconds.
C{twistd --logger=dallal.server.logs.rotatingLog -n dallal ...} writes the
same lines to a file rotated at C{DALLAL_LOG_ROTATE_BYTES} and keeps
C{DALLAL_LOG_KEEP} rotated files (README.md, "Logs").  twistd calls a
C{--logger} factory with no arguments, so its settings come from the
environment, as a service manager's unit file gives them.
"""

import os

from twisted.logger import textFileLogObserver
from twisted.python.logfile import LogFile

from dallal.numbers import positiveNumber

DEFAULT_PATH = "twistd.log"
DEFAULT_ROTATE_BYTES = 10 * 1024 * 1024
DEFAULT_KEEP = 10


def _whole(environ, name, default):
    text = environ.get(name)
    if text is None:
        return default
    try:
        return positiveNumber(text, name=name)
    except ValueError as error:
        raise SystemExit(f"dallal: cannot start: {error}") from None


def rotatingLogFile(environ=os.environ):
    """
    The broker's log file, as the environment says:

     - C{DALLAL_LOGFILE}: its path, C{twistd.log} by default;
     - C{DALLAL_LOG_ROTATE_BYTES}: the size at which it is rotated (renamed
       C{.1}, the older ones C{.2}, ...), 10 MiB by default;
     - C{DALLAL_LOG_KEEP}: how many rotated files are kept (the oldest is
       deleted), 10 by default.

    @raise SystemExit: a setting is wrong, or the file cannot be opened:
        one line saying which.
    """
    path = environ.get("DALLAL_LOGFILE", DEFAULT_PATH)
    rotateLength = _whole(environ, "DALLAL_LOG_ROTATE_BYTES", DEFAULT_ROTATE_BYTES)
    keep = _whole(environ, "DALLAL_LOG_KEEP", DEFAULT_KEEP)
    try:
        return LogFile.fromFullPath(path, rotateLength=rotateLength, maxRotatedFiles=keep)
    except OSError as error:
        raise SystemExit(
            f"dallal: cannot start: cannot open the log file {path}: {error.strerror}"
        ) from error


def rotatingLog():
    """
    A log observer writing to L{rotatingLogFile}, in twistd's own format.
    """
    return textFileLogObserver(rotatingLogFile())
