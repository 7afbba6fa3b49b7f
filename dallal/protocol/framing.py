"""
Stream framing: control lines, each optionally followed by a counted payload.

L{FrameReceiver} keeps L{LineReceiver}'s interface (C{lineReceived},
C{sendLine}, C{MAX_LENGTH}, C{lineLengthExceeded}, raw mode, pause and
resume) but replaces its C{dataReceived}: Twisted's copies the whole
remaining buffer for every line it splits off (twisted/twisted#6357), which
is quadratic when one read carries thousands of small pipelined frames.
This one walks the buffer with an offset and copies each line once.

It adds the one thing the Dallal wire format needs on top of lines: after a
control line announcing C{N} bytes, L{FrameReceiver.expectPayload} makes the
next C{N} bytes (whatever they contain, newlines included) and the line end
after them a single payload, handed to C{payloadReceived}.  A payload that
arrives over many reads is gathered in one C{bytearray}: what a slow sender
makes it hold is the bytes it sent, not an object per read.
"""

from twisted.protocols.basic import LineReceiver

_LF = 0x0A
_CR = 0x0D


class FrameReceiver(LineReceiver):
    """
    A L{LineReceiver} that also reads counted, binary-safe payloads.

    Lines may end with CRLF or a bare LF (so people can type frames into
    C{nc}); C{sendLine} always writes CRLF.

    @ivar MAX_LENGTH: the longest control line accepted, without its line end.
    """

    delimiter = b"\r\n"
    MAX_LENGTH = 4096

    # Payload state: bytes still wanted, whether they are kept or thrown away,
    # and what was kept so far (a payload may span many reads).
    _payloadWanted = 0
    _payloadSize = 0
    _payloadDiscard = False
    _payloadKept = None
    _awaitingTerminator = False
    # Frames (lines and payloads) received so far.
    framesReceived = 0
    # What a run of frames that L{runReceived} may take together begins
    # with, or C{None}.
    runStart = None

    def expectPayload(self, size, discard=False):
        """
        Read the next C{size} bytes and their line end as one payload.

        Call this from C{lineReceived}.  When the payload is complete,
        C{payloadReceived(payload)} is called, or C{payloadDiscarded(size)} if
        C{discard} is true (the bytes are counted, never stored: this is how a
        too-large payload is skipped without losing the stream's framing).
        """
        self._payloadWanted = size
        self._payloadSize = size
        self._payloadDiscard = discard
        self._payloadKept = bytearray()
        self._awaitingTerminator = True

    def payloadReceived(self, payload):
        """
        Override this to handle a payload announced with L{expectPayload}.
        """
        raise NotImplementedError

    def runReceived(self, buffer, position):
        """
        Override this to take together the frames at C{position} of
        C{buffer}, which begins there with L{runStart}, as many as it
        handles (counting them in C{framesReceived}).

        @return: where the frames it took end; C{position} if it took
            none: the frame there is then read as any other.
        """
        return position

    def payloadDiscarded(self, size):
        """
        Called when a payload read with C{discard=True} has been skipped.
        """

    def partialFrame(self):
        """
        Whether part of a frame (a line without its end, a payload not
        complete) has been received.
        """
        return self._awaitingTerminator or bool(self._buffer)

    def payloadTerminatorMissing(self):
        """
        Called when the bytes after a payload are not a line end: the peer
        sent a different number of bytes than it announced, so framing is
        lost.  The default closes the connection.
        """
        self.transport.loseConnection()

    def dataReceived(self, data):
        if self._closing():
            # The connection is being closed (after a framing error, say):
            # what else arrives no longer means anything.  A TCP transport
            # stops reading then, but TLS still delivers what it decrypts.
            return
        if self._busyReceiving:
            # Re-entered from a callback (for example setLineMode(extra)):
            # the outer call picks this up when its callback returns.
            self._buffer += data
            return
        self._busyReceiving = True
        try:
            while True:
                buffer = self._buffer + data if self._buffer else data
                self._buffer = b""
                data = b""
                consumed, why = self._consume(buffer)
                if consumed is None:
                    return why
                pending = self._buffer
                self._buffer = buffer[consumed:]
                if not pending or self.paused:
                    self._buffer += pending
                    return why
                data = pending
        finally:
            self._busyReceiving = False

    def _consume(self, buffer):
        """
        Deliver every complete line and payload at the front of C{buffer}.

        @return: C{(offset, why)}: how many bytes were used and what a
            callback asked to return; C{(None, why)} when the connection is
            being closed and the rest of the buffer no longer matters.
        """
        end = len(buffer)
        position = 0
        # The transport stays the same for the whole call: whether it is
        # closing is read from it after each frame, without a call.
        transport = self.transport
        runStart = self.runStart
        while position < end and not self.paused:
            if self._awaitingTerminator:
                wanted = self._payloadWanted
                if (
                    wanted == self._payloadSize
                    and not self._payloadDiscard
                    and buffer.startswith(b"\r\n", position + wanted)
                ):
                    # The common case, one pipelined PUB after another: the
                    # whole payload and its CRLF are in this buffer, so take
                    # them in one step, without collecting parts.
                    payload = buffer[position : position + wanted]
                    position += wanted + 2
                    self._awaitingTerminator = False
                    self._payloadKept = None
                    self.framesReceived += 1
                    why = self.payloadReceived(payload)
                    if why or (transport is not None and transport.disconnecting):
                        return None, why
                    continue
                if wanted:
                    take = min(wanted, end - position)
                    if not self._payloadDiscard:
                        self._payloadKept += memoryview(buffer)[position : position + take]
                    position += take
                    self._payloadWanted -= take
                    continue
                first = buffer[position]
                if first == _LF:
                    position += 1
                elif first == _CR:
                    if position + 1 == end:
                        break
                    if buffer[position + 1] != _LF:
                        self._awaitingTerminator = False
                        return None, self.payloadTerminatorMissing()
                    position += 2
                else:
                    self._awaitingTerminator = False
                    return None, self.payloadTerminatorMissing()
                self._awaitingTerminator = False
                kept, self._payloadKept = self._payloadKept, None
                self.framesReceived += 1
                if self._payloadDiscard:
                    why = self.payloadDiscarded(self._payloadSize)
                else:
                    why = self.payloadReceived(bytes(kept))
                if why or (transport is not None and transport.disconnecting):
                    return None, why
            elif self.line_mode:
                if runStart is not None and buffer.startswith(runStart, position):
                    taken = self.runReceived(buffer, position)
                    if taken != position:
                        position = taken
                        if transport is not None and transport.disconnecting:
                            return None, None
                        continue
                lineEnd = buffer.find(b"\n", position)
                if lineEnd < 0:
                    # Allow for the CR of a CRLF still to come.
                    if end - position > self.MAX_LENGTH + 1:
                        return None, self.lineLengthExceeded(buffer[position:])
                    break
                if lineEnd > position and buffer[lineEnd - 1] == _CR:
                    line = buffer[position : lineEnd - 1]
                else:
                    line = buffer[position:lineEnd]
                position = lineEnd + 1
                if len(line) > self.MAX_LENGTH:
                    return None, self.lineLengthExceeded(line)
                self.framesReceived += 1
                why = self.lineReceived(line)
                if why or (transport is not None and transport.disconnecting):
                    return None, why
            else:
                chunk = buffer[position:] if position else buffer
                position = end
                why = self.rawDataReceived(chunk)
                if why:
                    return None, why
        return position, None

    def _closing(self):
        return self.transport is not None and self.transport.disconnecting
