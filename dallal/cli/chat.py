"""
C{dallal <host> <port> chat <topic> [--name NAME]}: the seeds' two-way chat
on one topic.

Each line typed is published on the topic as C{<name>: <line>} (UTF-8), and
what others publish there is printed as it arrives, payload as it is: so a
plain C{dallal publish room "bob: hi"} reads as a line from bob, and a
C{dallal subscribe room} sees C{room: alice: hello}.  One's own lines are
not printed again: the chat subscribes in mode C{all}, so each line it
publishes comes back to it exactly once, and that copy is skipped.
"""

import getpass
import socket
from collections import Counter

from twisted.internet.error import ConnectionDone, ConnectionLost

from dallal.cli.shell import ConsoleClient, describeError
from dallal.modes import ALL


def defaultName():
    """
    C{user@host}, for people who do not say who they are.
    """
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        # No login name in the environment nor in the password database.
        user = "someone"
    return f"{user}@{socket.gethostname()}"


def checkNickname(name):
    """
    @raise ValueError: C{name} cannot head a line of chat.
    """
    if not name.strip() or not name.isprintable():
        raise ValueError(f"a name must be printable and not blank, not {name!r}")


class Chat(ConsoleClient):
    """
    One person's side of a chat on a topic.
    """

    def __init__(self, clock, client, console, timeout, sayBye, topic, name):
        ConsoleClient.__init__(self, clock, client, console, timeout, sayBye)
        self.topic = topic
        self.name = name
        # Payloads published and not yet received back, by count.
        self._unechoed = Counter()

    def start(self):
        # Through the lock: lines typed meanwhile wait until it is done.
        self._lock.run(self._join)

    async def _join(self):
        try:
            await self.answer(self.client.subscribe([self.topic], self._messageReceived, ALL))
        except (ConnectionDone, ConnectionLost):
            # Said once, by _disconnected.
            return
        except Exception as error:
            self._leaving = True
            self.console.printError(describeError(error, self.timeout))
            await self.client.close()
            self.finished.callback(1)
            return
        self.console.printLine(f"chatting on {self.topic} as {self.name}")

    async def execute(self, line):
        if not line.strip():
            return
        payload = f"{self.name}: {line}".encode("utf-8", "surrogateescape")
        self._unechoed[payload] += 1
        try:
            await self.answer(self.client.publish(self.topic, payload))
        except Exception:
            # Refused or unanswered: no copy is on its way back.
            self._forget(payload)
            raise

    def _forget(self, payload):
        self._unechoed[payload] -= 1
        if not self._unechoed[payload]:
            del self._unechoed[payload]

    def _messageReceived(self, message):
        if message.payload in self._unechoed:
            self._forget(message.payload)
        else:
            self.console.printMessage("", message.payload)
