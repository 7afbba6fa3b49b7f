"""
A bridged message's origin on the wire (L{dallal.server.origins}): the
options a frame carries and the L{Origin} the broker takes, both ways.
"""

import pytest

from dallal.broker.origin import Origin
from dallal.server.origins import originFromOptions, originOptions


def test_anOriginRoundTripsThroughItsOptions():
    origin = Origin("leaf", "a1.5", 3)
    assert originOptions(origin) == {"origin": "leaf", "oid": "a1.5", "hops": "3"}
    assert originFromOptions(originOptions(origin)) == origin


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"oid": "a1.5", "hops": "0"}, Origin("", "a1.5", 0)),
        ({"origin": "leaf", "hops": "0"}, Origin("leaf", "", 0)),
        ({"origin": "leaf", "oid": "a1.5"}, Origin("leaf", "a1.5", None)),
        ({"origin": "leaf", "oid": "a1.5", "hops": "many"}, Origin("leaf", "a1.5", None)),
        ({"origin": "leaf", "oid": "a1.5", "hops": "\u00b2"}, Origin("leaf", "a1.5", None)),
    ],
    ids=["no_origin", "no_oid", "no_hops", "hops_word", "hops_superscript"],
)
def test_missingOrMalformedOptionsGiveAnOriginTheBrokerRefuses(options, expected):
    """
    Options are read, not judged: what is missing is empty, hops that are
    no number are C{None}, and the broker's L{checkOrigin} refuses both.
    """
    assert originFromOptions(options) == expected
