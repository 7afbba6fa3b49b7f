"""
Headless Chromium for the tests, driven over the DevTools protocol on a
pipe (C{--remote-debugging-pipe}: commands on its descriptor 3, answers on
4, each a JSON message ending with a NUL byte), with a bounded wait on
every answer.
"""

import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# What the tests need of Chromium here: no sandbox (no user namespaces in
# a container), no GPU, and nothing from the network but the page.
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
)
ANSWER_TIMEOUT = 30.0


class Browser:
    """
    One headless Chromium with one page, on a profile of its own.
    """

    def __init__(self, width=1000, height=900):
        self._profile = tempfile.mkdtemp(prefix="dallal-chromium-")
        commandsRead, self._commands = os.pipe()
        self._answers, answersWritten = os.pipe()
        self.process = subprocess.Popen(
            [
                CHROMIUM,
                *FLAGS,
                f"--user-data-dir={self._profile}",
                f"--window-size={width},{height}",
                "about:blank",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            # Chromium expects the pipes as its descriptors 3 and 4.
            pass_fds=(3, 4),
            preexec_fn=lambda: _asDescriptors3And4(commandsRead, answersWritten),
        )
        os.close(commandsRead)
        os.close(answersWritten)
        self._buffer = b""
        self._nextId = 1
        self._session = None

    def open(self, url):
        """
        Open C{url} in a new page, which later calls act on.
        """
        target = self.call("Target.createTarget", url=url)["targetId"]
        self._session = self.call("Target.attachToTarget", targetId=target, flatten=True)[
            "sessionId"
        ]

    def evaluate(self, expression):
        """
        The value of a JavaScript expression in the page.
        """
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result["result"].get("value")

    def waitUntil(self, expression, timeout, what):
        """
        Wait until a JavaScript expression is true in the page.

        @raise AssertionError: it was not within C{timeout} seconds.
        """
        deadline = time.monotonic() + timeout
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise AssertionError(f"no {what} within {timeout} s")
            time.sleep(0.1)

    def screenshot(self, path):
        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as file:
            file.write(base64.b64decode(data))

    def call(self, method, **params):
        """
        Send one DevTools command (to the page, once one is open) and
        return its result.
        """
        message = {"id": self._nextId, "method": method, "params": params}
        self._nextId += 1
        if self._session is not None:
            message["sessionId"] = self._session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + ANSWER_TIMEOUT
        while True:
            answer = self._read(deadline, method)
            if answer.get("id") == message["id"]:
                if "error" in answer:
                    raise AssertionError(f"{method}: {answer['error']}")
                return answer["result"]

    def _read(self, deadline, method):
        while b"\0" not in self._buffer:
            remaining = deadline - time.monotonic()
            readable, _, _ = select.select([self._answers], [], [], max(remaining, 0))
            chunk = os.read(self._answers, 1 << 20) if readable else b""
            if not chunk:
                raise AssertionError(f"Chromium gave no answer to {method}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def close(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(ANSWER_TIMEOUT)
        os.close(self._commands)
        os.close(self._answers)
        shutil.rmtree(self._profile, ignore_errors=True)


def _asDescriptors3And4(commands, answers):
    # In the child, before exec: the pipe ends where Chromium looks for
    # them, by way of descriptors above both (one of them may be 3 or 4).
    commands = fcntl.fcntl(commands, fcntl.F_DUPFD, 10)
    answers = fcntl.fcntl(answers, fcntl.F_DUPFD, 10)
    os.dup2(commands, 3)
    os.dup2(answers, 4)
