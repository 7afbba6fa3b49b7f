"""
Numbers in text that comes from outside: the wire, command lines, files.
"""


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
