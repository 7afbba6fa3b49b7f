"""
C{dallal-report} on a broker installed without the analytics extra.
"""

import sys

import pytest

from dallal.cli import report


def test_without_pyspark_says_how_to_install_it(monkeypatch):
    """
    With PySpark missing, the command exits with one line naming the extra
    to install, not an import traceback.
    """
    for name in list(sys.modules):
        if name.startswith(("dallal_analytics", "pyspark")):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "pyspark", None)
    with pytest.raises(SystemExit) as exited:
        report.main()
    assert exited.value.code == report.MISSING


def test_the_reports_exit_status_is_the_commands(monkeypatch):
    """
    With the analytics installed, the command's exit status is the
    report's (console scripts exit with what main returns).
    """
    import types

    monkeypatch.setitem(
        sys.modules, "dallal_analytics.report", types.SimpleNamespace(main=lambda: 1)
    )
    assert report.main() == 1
