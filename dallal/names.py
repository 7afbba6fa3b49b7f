"""
Names of users and brokers: what the password file, the client, the
command line and bridges accept.  Both are one word of 1 to 64 characters
that starts with a letter or a digit, as they stand on the control line
(and a broker's name as a level of C{$SYS} topics).
"""

import re


def _nameRule(punctuation):
    return re.compile(rf"[A-Za-z0-9][A-Za-z0-9{re.escape(punctuation)}]{{0,63}}\Z")


# A user name may also be an e-mail address.
USER_NAME = _nameRule("._@-")
BROKER_NAME = _nameRule("._-")


def _check(rule, name, what, characters):
    if not rule.match(name):
        raise ValueError(
            f"{what} {name!r} must be 1 to 64 {characters}, starting with a letter or a digit"
        )


def checkUserName(name, what="user name"):
    """
    @raise ValueError: C{name} is not a valid user name, with the rule.
    """
    _check(USER_NAME, name, what, "letters, digits, '.', '_', '@' or '-'")


def checkBrokerName(name, what="broker name"):
    """
    @raise ValueError: C{name} is not a valid broker name, with the rule.
    """
    _check(BROKER_NAME, name, what, "letters, digits, '.', '_' or '-'")
