"""
Delivery modes: how a subscription wants its messages (PROTOCOL.md,
"Delivery modes").  The client asks for one, the broker keeps its promise.

 - C{latest}: one message in flight per topic until acked; a newer one waits
   and a still newer one replaces it.
 - C{all}: every message until acked, at least once.
 - C{fire}: sent once, never acked, at most once.
"""

LATEST = "latest"
ALL = "all"
FIRE = "fire"
MODES = (LATEST, ALL, FIRE)
