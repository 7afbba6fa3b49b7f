"""
The C{dallal-report} command: a launcher for the log analytics
(L{dallal_analytics.report}), which need the C{analytics} extra.  A broker
installed without it gets one line saying how to install them, not an
import traceback.
"""

import sys

MISSING = (
    "dallal-report: the log analytics are not installed: "
    "pip install 'dallal[analytics]' (PySpark; Spark also needs Java 17 or later)"
)


def main():
    try:
        from dallal_analytics.report import main as report
    except ModuleNotFoundError as error:
        if (error.name or "").split(".")[0] not in ("pyspark", "py4j"):
            raise
        sys.exit(MISSING)
    return report()
