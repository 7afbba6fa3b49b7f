"""
A bridged message's origin on Dallal's wire: the C{origin=<broker>
oid=<message id> hops=<n>} options of C{PUB} and C{MSG} (PROTOCOL.md,
"Bridges"), to and from the broker's L{dallal.broker.origin.Origin}.
"""

from dallal.broker.origin import Origin
from dallal.numbers import wholeNumber


def originOptions(origin):
    """
    The C{key=value} options, as text, that carry C{origin} in a C{PUB} or
    C{MSG} frame.
    """
    return {"origin": origin.broker, "oid": origin.messageId, "hops": str(origin.hops)}


def originFromOptions(options):
    """
    The origin a bridged C{PUB} or C{MSG} carries, as sent (its C{hops} do
    not count the bridge it came over yet), unchecked: the broker refuses a
    bad one (L{dallal.broker.origin.checkOrigin}) and counts it.

    @return: an L{Origin} whose fields missing from C{options} are empty,
        and whose C{hops} is C{None} if they are not a number.
    """
    return Origin(
        options.get("origin", ""),
        options.get("oid", ""),
        wholeNumber(options.get("hops", ""), 3),
    )
