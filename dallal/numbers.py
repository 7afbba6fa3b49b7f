"""
Numbers in text that comes from outside: the wire, command lines, files.
"""

import math

# The greatest TCP or UDP port number.
MAX_PORT = 65535


def wholeNumber(text, maxDigits):
    """
    The whole number C{text} writes with 1 to C{maxDigits} ASCII digits.

    Numbers on the wire are ASCII digits only: C{str.isdigit} also takes
    superscripts (C{"²"}, which C{int} then refuses) and other scripts'
    digits, and C{int} also takes signs, spaces and underscores.

    @param text: C{str} or C{bytes}.
    @return: the number, or C{None} if C{text} is anything else.
    """
    if 0 < len(text) <= maxDigits and text.isascii() and text.isdigit():
        return int(text)
    return None


def positiveNumber(
    text, kind=int, zero=False, minimum=None, maximum=None, name="", error=ValueError
):
    """
    The number an option's value C{text} writes, which must be finite and
    positive: the one converter of the broker's options (L{dallal.server.tap},
    its configuration file), the command line's and the analytics report's.

    @param kind: C{int} for a whole number, C{float} for any.
    @param zero: whether 0 is taken too (an option 0 turns off).
    @param minimum: the least whole number taken, if more than 1.
    @param maximum: the greatest whole number taken, if any.
    @param name: what the error message names (C{"--max-payload"}), or
        nothing where the caller's framework names the option itself.
    @param error: the exception raised with the message, the one the
        caller's framework shows as a line of its own
        (L{twisted.python.usage.UsageError} for twistd,
        L{argparse.ArgumentTypeError} for argparse).
    @raise error: C{text} is not such a number.
    """
    try:
        value = kind(text)
    except (ValueError, OverflowError):
        value = None
    if kind is int:
        least = minimum if minimum is not None else 0 if zero else 1
        bounds = f"of at least {least}" if maximum is None else f"from {least} to {maximum}"
        wanted = f"a whole number {bounds}"
        taken = value is not None and least <= value and (maximum is None or value <= maximum)
    else:
        wanted = "a number, positive or 0" if zero else "a number, positive"
        taken = value is not None and math.isfinite(value) and (value > 0 or zero and value == 0)
    if not taken:
        subject = f"{name} must be" if name else "must be"
        raise error(f"{subject} {wanted}, not {text!r}")
    return value
