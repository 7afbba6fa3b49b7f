"""
The line console of the interactive commands (C{shell}, C{chat}): lines
read from standard input, lines printed on standard output, no threads.

When standard input and output are both a terminal, L{TerminalConsole}
edits the line being typed itself (Twisted's insults and recvline, in raw
mode): a line printed while one is half typed goes above it, and the prompt
and the partial input are drawn again below.  Otherwise L{PipeConsole}
reads lines and prints without a prompt or any terminal control sequence.

A console hands its handler each line (C{handler.lineReceived(text)}) and
tells it when input ends (C{handler.inputEnded()}): end of file, Ctrl-D on
an empty line or Ctrl-C.  It prints with L{printLine}, L{printError} and
L{printMessage}, and L{close} flushes what is left to print and gives the
terminal back as it was.
"""

import codecs
import fcntl
import os
import sys
import termios
import tty

from twisted.conch.insults.insults import ServerProtocol
from twisted.conch.recvline import HistoricRecvLine
from twisted.internet import stdio
from twisted.internet.defer import Deferred, succeed
from twisted.internet.interfaces import IHalfCloseableProtocol
from twisted.protocols.basic import LineReceiver
from zope.interface import implementer

CTRL_A = b"\x01"
CTRL_C = b"\x03"
CTRL_D = b"\x04"
CTRL_E = b"\x05"
CTRL_H = b"\x08"

DEFAULT_COLUMNS = 80


def displayable(payload):
    """
    A payload as text that is safe to show on a terminal: UTF-8 (invalid
    bytes replaced), its line ends kept, and every other control character
    written as an escape, so that nobody can move the cursor or change the
    colours of someone else's terminal by publishing.
    """
    text = payload.decode("utf-8", "replace").replace("\r\n", "\n")
    return "".join(
        character
        if character.isprintable() or character in "\n\t"
        else character.encode("unicode_escape").decode("ascii")
        for character in text
    )


class _Closing:
    """
    Whether a console's output is closed, and who waits for it.
    """

    def __init__(self):
        self.done = False
        self._waiters = []

    def fire(self):
        if not self.done:
            self.done = True
            waiters, self._waiters = self._waiters, []
            for waiter in waiters:
                waiter.callback(None)

    def wait(self):
        if self.done:
            return succeed(None)
        waiter = Deferred()
        self._waiters.append(waiter)
        return waiter


@implementer(IHalfCloseableProtocol)
class PipeConsole(LineReceiver):
    """
    The console when standard input or output is not a terminal: each line
    read is handed over (a CRLF line end is taken as LF), what is printed
    is written as it is, errors go to standard error.
    """

    interactive = False
    delimiter = b"\n"
    # Larger than any payload a broker accepts by default, so that a chat
    # line from a file is never cut.
    MAX_LENGTH = 4 * 1024 * 1024

    def __init__(self, errors):
        """
        @param errors: a text file for error lines (standard error).
        """
        self.handler = None
        self._errors = errors
        self._inputEnded = False
        self.closing = _Closing()

    def lineReceived(self, line):
        if self._inputEnded:
            return
        # surrogateescape keeps bytes that are not UTF-8 as they were read.
        self.handler.lineReceived(line.removesuffix(b"\r").decode("utf-8", "surrogateescape"))

    def _endInput(self):
        if not self._inputEnded:
            self._inputEnded = True
            self.handler.inputEnded()

    def lineLengthExceeded(self, line):
        # What follows cannot be told apart into lines: stop reading.
        self.transport.pauseProducing()
        self.printError(f"a line longer than {self.MAX_LENGTH} bytes: reading stops here")
        self._endInput()

    def readConnectionLost(self):
        # The last line may have no line end.
        rest = self.clearLineBuffer()
        if rest:
            self.lineReceived(rest)
        self._endInput()

    def writeConnectionLost(self):
        # Nobody reads what is printed any more: nothing left to do.
        self.closing.fire()
        self._endInput()

    def connectionLost(self, reason):
        self.closing.fire()

    def printLine(self, text):
        self.transport.write(text.encode("utf-8", "surrogateescape") + b"\n")

    def printMessage(self, prefix, payload):
        # Payloads are written byte for byte, as the subscribe command does.
        self.transport.write(prefix.encode("utf-8") + payload + b"\n")

    def printError(self, text):
        print(f"error: {text}", file=self._errors, flush=True)

    def close(self):
        """
        Stop reading, and close standard output once everything printed is
        written.

        @return: a Deferred that fires then.
        """
        self.transport.loseConnection()
        return self.closing.wait()


class TerminalConsole(HistoricRecvLine):
    """
    The console on a terminal: a prompt and an editable input line (arrows,
    Home, End, Ctrl-A, Ctrl-E, Backspace, Delete, history with Up and Down),
    with everything printed going above it.

    Unlike L{HistoricRecvLine} it leaves the screen as it is (no reset), it
    does not switch the terminal to insert mode (which would outlive a
    crash), and it takes UTF-8 input.
    """

    interactive = True

    def __init__(self, prompt, columns):
        """
        @param prompt: text shown before the input line.
        @param columns: returns the terminal's width now.
        """
        self.handler = None
        self.ps = (prompt.encode("utf-8"),) * 2
        self._promptWidth = len(prompt)
        self._columns = columns
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._inputEnded = False
        self.closing = _Closing()

    def connectionMade(self):
        HistoricRecvLine.connectionMade(self)
        # Spaces at the end of the line are all RecvLine's Tab can insert.
        del self.keyHandlers[self.terminal.TAB]
        self.keyHandlers.update(
            {
                CTRL_A: self.handle_HOME,
                CTRL_E: self.handle_END,
                CTRL_H: self.handle_BACKSPACE,
                CTRL_C: self._endInput,
                CTRL_D: self.handle_CTRL_D,
            }
        )

    def initializeScreen(self):
        self.mode = "insert"
        self.drawInputLine()

    def setInsertMode(self):
        self.mode = "insert"

    def setTypeoverMode(self):
        self.mode = "typeover"

    def terminalSize(self, width, height):
        # The width is asked for when it matters; RecvLine's version clears
        # the screen.
        pass

    # Input

    def keystrokeReceived(self, keyID, modifier):
        if self._inputEnded:
            return
        handler = self.keyHandlers.get(keyID)
        if handler is not None:
            handler()
        elif modifier is None and len(keyID) == 1:
            # Function keys without a handler have longer names; bytes of a
            # UTF-8 sequence wait in the decoder until it is complete.
            for character in self._decoder.decode(keyID):
                if character.isprintable():
                    self.characterReceived(character.encode("utf-8"), False)

    def characterReceived(self, ch, moreCharactersComing):
        if self.mode == "typeover":
            HistoricRecvLine.characterReceived(self, ch, moreCharactersComing)
            return
        # Insert without the terminal's insert mode: draw the rest of the
        # line again after the new character.
        self.lineBuffer.insert(self.lineBufferIndex, ch)
        self.lineBufferIndex += 1
        after = self.lineBuffer[self.lineBufferIndex :]
        self.terminal.write(ch + b"".join(after))
        if after:
            self.terminal.cursorBackward(len(after))

    def handle_CTRL_D(self):
        if self.lineBuffer:
            self.handle_DELETE()
        else:
            self._endInput()

    def lineReceived(self, line):
        self.drawInputLine()
        self.handler.lineReceived(line.decode("utf-8"))

    def _endInput(self):
        if not self._inputEnded:
            self._inputEnded = True
            self.handler.inputEnded()

    # Output

    def _cursorRow(self):
        """
        The row of the input line the cursor is on, 0 for the first: a long
        input wraps onto several rows.
        """
        width = self._columns()
        column = self._promptWidth + self.lineBufferIndex
        atEnd = self.lineBufferIndex == len(self.lineBuffer)
        if atEnd and column and column % width == 0:
            # Having filled a row, the cursor stays on it until the next
            # character.
            return column // width - 1
        return column // width

    def _eraseInputLine(self):
        row = self._cursorRow()
        if row:
            self.terminal.cursorUp(row)
        self.terminal.write(b"\r")
        self.terminal.eraseToDisplayEnd()

    def _printAbove(self, text):
        self._eraseInputLine()
        self.terminal.write(text.encode("utf-8") + b"\n")
        self.drawInputLine()
        after = len(self.lineBuffer) - self.lineBufferIndex
        if after:
            self.terminal.cursorBackward(after)

    def printLine(self, text):
        self._printAbove(text)

    def printMessage(self, prefix, payload):
        self._printAbove(prefix + displayable(payload))

    def printError(self, text):
        self._printAbove(f"error: {text}")

    def connectionLost(self, reason):
        self.closing.fire()

    def close(self):
        """
        Take the prompt and the input line off the screen, and close once
        everything printed is written.

        @return: a Deferred that fires then.
        """
        if not self.closing.done:
            self._eraseInputLine()
            # Not the insults transport's loseConnection: it resets the
            # terminal, clearing the screen.
            self.terminal.transport.loseConnection()
        return self.closing.wait()


def _terminalColumns(descriptor):
    try:
        columns = os.get_terminal_size(descriptor).columns
    except OSError:
        columns = 0
    # A pseudo-terminal nobody sized says 0.
    return columns or DEFAULT_COLUMNS


class _DescriptorState:
    """
    What Twisted's standard I/O changes about the process's standard input
    and output, to put back when the command ends: it makes them
    non-blocking, which the shell that started the command would otherwise
    inherit on a terminal; and raw mode, on a terminal.
    """

    def __init__(self, stdin, stdout, terminal):
        self._descriptors = [(fd, fcntl.fcntl(fd, fcntl.F_GETFL)) for fd in (stdin, stdout)]
        self._stdin = stdin
        self._stdout = stdout
        self._terminal = termios.tcgetattr(stdin) if terminal else None
        self._restored = False

    def restore(self):
        if self._restored:
            return
        self._restored = True
        for fd, flags in self._descriptors:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        if self._terminal is not None:
            try:
                # A console closed has already taken its prompt off the
                # screen; one stopped by a signal has not.
                os.write(self._stdout, b"\r\x1b[K")
                termios.tcsetattr(self._stdin, termios.TCSADRAIN, self._terminal)
            except OSError:
                # The terminal is gone (hung up): nothing to give back.
                pass


def openConsole(reactor, prompt, makeHandler, stdin=0, stdout=1):
    """
    Start reading standard input and writing standard output through a
    console: a L{TerminalConsole} if both are terminals, else a
    L{PipeConsole}.

    @param prompt: what a terminal shows before the input line.
    @param makeHandler: called with the console, returns its handler.
    @return: the console; its C{handler} is what C{makeHandler} returned.
    """
    terminal = os.isatty(stdin) and os.isatty(stdout)
    state = _DescriptorState(stdin, stdout, terminal)
    if terminal:
        # TCSANOW: keep what was typed before the console started.
        tty.setraw(stdin, termios.TCSANOW)
        console = TerminalConsole(prompt, lambda: _terminalColumns(stdout))
        protocol = ServerProtocol(lambda: console)
    else:
        console = protocol = PipeConsole(sys.stderr)
    console.handler = makeHandler(console)
    # Put the descriptors back once the console is closed, or when the
    # reactor stops without closing it (SIGTERM).
    console.closing.wait().addCallback(lambda _: state.restore())
    reactor.addSystemEventTrigger("after", "shutdown", state.restore)
    stdio.StandardIO(protocol, stdin, stdout, reactor)
    return console
