"""
The package as users install it: into a fresh virtual environment, with and
without C{-e}, twistd must find the C{dallal} plugin and run the broker.
"""

import re
import shutil
import subprocess
import sys
import urllib.request

import pytest
from helpers import (
    HTTP_LISTENING,
    LOOPBACK_ANY_PORT,
    REPO,
    BrokerProcess,
    dallal,
    environmentWithout,
)

pytestmark = pytest.mark.e2e

INSTALL_TIMEOUT = 240


def copyOfWorkingTree(destination):
    """
    Copy the checkout's files (tracked, and new ones not ignored) to
    C{destination}: installing builds in the source folder, and the tests
    must not write into the repository.
    """
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
        timeout=30,
    ).stdout
    for name in listed.decode().split("\0"):
        source = REPO / name
        if name and source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return destination


def run(argv, cwd=None):
    """
    Run a command to completion, outside this process's Python paths.
    """
    argv = [str(arg) for arg in argv]
    result = subprocess.run(
        argv,
        cwd=cwd,
        capture_output=True,
        timeout=INSTALL_TIMEOUT,
        env=environmentWithout("PYTHONPATH", "PYTHONHOME"),
    )
    assert result.returncode == 0, (
        f"{' '.join(argv)}: exit status {result.returncode}\n"
        f"{result.stdout.decode(errors='replace')}{result.stderr.decode(errors='replace')}"
    )
    return result


@pytest.mark.timeout(3 * INSTALL_TIMEOUT + 60)
def test_installedBrokerRuns(tmp_path):
    """
    Installed as a user installs it, then again with C{-e} (into the same
    environment, whose dependencies are there by then: pip replaces the
    package), the broker runs from the installed copy each time.
    """
    source = copyOfWorkingTree(tmp_path / "source")
    venv = tmp_path / "venv"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run([sys.executable, "-m", "venv", venv])
    for editable in (False, True):
        run(
            [venv / "bin" / "python", "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            + (["-e", source] if editable else [source]),
            cwd=elsewhere,
        )
        checkInstalled(venv, source if editable else venv, elsewhere)


def checkInstalled(venv, expected, elsewhere):
    """
    The package comes from C{expected} (the copy the venv installed, not
    the checkout or the global site-packages), and its plugin and console
    scripts work.
    """
    python = venv / "bin" / "python"
    imported = run(
        [python, "-c", "import dallal; print(dallal.__file__)"], cwd=elsewhere
    ).stdout.decode()
    assert imported.startswith(str(expected)), imported

    usage = run([venv / "bin" / "twistd", "--help"], cwd=elsewhere).stdout.decode()
    listed = re.search(r"^\s+dallal\s+A publish/subscribe message broker", usage, re.MULTILINE)
    assert listed, usage

    broker = BrokerProcess.plugin(
        elsewhere,
        "--http",
        LOOPBACK_ANY_PORT,
        twistd=venv / "bin" / "twistd",
        env=environmentWithout("PYTHONPATH", "PYTHONHOME"),
    )
    try:
        # The dashboard's page is installed with the package.
        httpPort = int(broker.waitFor(HTTP_LISTENING).group(1))
        with urllib.request.urlopen(f"http://127.0.0.1:{httpPort}/", timeout=30) as page:
            assert b"<title>Dallal broker</title>" in page.read()
        result = dallal(
            "127.0.0.1",
            broker.port,
            "publish",
            "news",
            "installed",
            executable=venv / "bin" / "dallal",
        )
        assert result.stdout == b"your message published successfully\n"
    finally:
        broker.stop()

    # The second console script.
    passwords = elsewhere / "passwords"
    passwords.unlink(missing_ok=True)
    result = subprocess.run(
        [venv / "bin" / "dallal-passwd", passwords, "alice"],
        env={**environmentWithout("PYTHONPATH", "PYTHONHOME"), "DALLAL_PASSWORD": "pw"},
        capture_output=True,
        timeout=INSTALL_TIMEOUT,
    )
    assert result.stdout == f"added alice to {passwords}\n".encode(), result.stderr
    assert passwords.read_text().startswith("alice:$scrypt$")


def test_noPluginCacheTracked():
    """
    twistd writes C{dropin.cache} next to the plugins it scans; it belongs
    to each installation, never to the repository.
    """
    tracked = (
        subprocess.run(["git", "ls-files"], cwd=REPO, check=True, capture_output=True, timeout=30)
        .stdout.decode()
        .splitlines()
    )
    assert "twisted/plugins/dallal_plugin.py" in tracked
    assert [name for name in tracked if name.endswith("dropin.cache")] == []


def test_theBrokerDoesNotImportTheAnalytics():
    """
    The broker's install has no PySpark (an extra, `analytics`): neither
    the twistd plugin nor the command line imports it.
    """
    checked = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, dallal.server.tap, dallal.cli.main; "
            "print(sorted(name for name in sys.modules "
            "if name.split('.')[0] in ('pyspark', 'py4j', 'dallal_analytics')))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert checked.stdout == "[]\n", checked.stderr
