"""
Passwords from people, for C{dallal --user} and C{dallal-passwd}: from the
C{DALLAL_PASSWORD} environment variable when it is set (for scripts),
otherwise typed on the terminal without echo.  Never from standard input,
which may be a shell's commands or a chat's lines: without a terminal, the
variable is the only way.
"""

import getpass
import os
import warnings

PASSWORD_VARIABLE = "DALLAL_PASSWORD"


class NoTerminal(ValueError):
    """
    The password was to be typed, and there is no terminal to type it on.
    """


def passwordFromEnvironment():
    """
    @return: the bytes of C{DALLAL_PASSWORD}, or C{None} if it is not set.
    """
    return os.environb.get(PASSWORD_VARIABLE.encode("ascii"))


def askPassword(prompt):
    """
    Ask for a password on the terminal, without echo.

    @return: its bytes.
    @raise NoTerminal: there is no terminal.
    @raise EOFError: the input ended (Ctrl-D).
    """
    with warnings.catch_warnings():
        # Without a terminal getpass falls back to standard input, with
        # echo, after this warning: stop it there.
        warnings.simplefilter("error", getpass.GetPassWarning)
        try:
            typed = getpass.getpass(prompt)
        except getpass.GetPassWarning:
            raise NoTerminal(
                f"no terminal to type the password on: set {PASSWORD_VARIABLE}"
            ) from None
    return os.fsencode(typed)
