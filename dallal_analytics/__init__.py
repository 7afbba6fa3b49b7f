"""
Analytics over Dallal broker logs, on Spark: the C{dallal-report} command
(L{dallal_analytics.report}) and, for notebooks, L{load} and the questions
of L{dallal_analytics.notebook}.
"""

from dallal_analytics.notebook import (
    errors,
    health,
    latency,
    load,
    lossAccount,
    messages,
    sessions,
    topics,
    topicTraffic,
    traffic,
)

__all__ = [
    "errors",
    "health",
    "latency",
    "load",
    "lossAccount",
    "messages",
    "sessions",
    "topicTraffic",
    "topics",
    "traffic",
]
