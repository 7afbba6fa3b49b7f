"""
User names: what the password file, the client and the command line accept.
"""

import re

USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}")


def checkUserName(name):
    """
    @raise ValueError: C{name} is not a valid user name, with the rule.
    """
    if not USER_NAME.fullmatch(name):
        raise ValueError(
            f"bad user name {name!r}: 1 to 64 letters, digits and . _ @ -, "
            "starting with a letter or digit"
        )
