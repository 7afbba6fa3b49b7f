"""
Minimal raw-socket clients for bench/compare.py: Dallal (PROTOCOL.md),
MQTT 3.1.1, Redis pub/sub (RESP2) and NATS, just enough to subscribe,
publish pre-encoded frames and count what arrives.

Each client encodes its handshakes and frames; each connection's bytes go
through a L{Stream}, which counts message frames and acknowledgements and
says what to answer (PONGs, and the acks of Dallal's C{mode=all} and of
MQTT QoS 1).  The streams count whole reads at C speed whenever a read holds
nothing but the frames that repeat (the messages, or the publisher's acks),
so that the load generator costs far less than the broker it measures.
"""

import re
import struct
import time

from brokerproc import BenchError

# A payload starting with this marks a publisher's last message: a
# subscriber that has one from every publisher it hears has had everything
# it will get.
LAST_MARKER = b"LAST"
# A payload starting with T and 19 digits carries the time it was sent, in
# CLOCK_MONOTONIC nanoseconds, which every process on the machine shares.
TIMESTAMP = re.compile(rb"T(\d{19})")
FILLER = b"x"


def countLastMarkers(buffer, end):
    """
    The last-message markers in C{buffer} before C{end}.  It looks for their
    first byte with C{find}, which is C{memchr}: counting a 4-byte string
    with C{bytes.count} reads a 64 KiB payload 20 times slower.
    """
    markers = 0
    position = buffer.find(LAST_MARKER[:1], 0, end)
    while position >= 0:
        markers += buffer.startswith(LAST_MARKER, position, end)
        position = buffer.find(LAST_MARKER[:1], position + 1, end)
    return markers


def payload(size):
    return FILLER * size


def lastPayload(size):
    return LAST_MARKER + FILLER * (size - len(LAST_MARKER))


def stampedPayload(size):
    stamp = b"T%019d" % time.monotonic_ns()
    return stamp + FILLER * (size - len(stamp))


# A message is counted once this much of its payload has arrived: enough
# for its marker or timestamp.  The rest is skipped unread, so a 64 KiB
# payload costs no more than a short one.
PAYLOAD_PREFIX = 24


class Stream:
    """
    The bytes one benchmark connection receives from its broker.

    Subclasses parse one frame at a time in L{_consumeFrame}, and may count
    many at once in L{_consumeBulk}.  A message is counted as soon as the
    start of its payload is in (L{_messageEnd}); what remains of it is
    skipped as it arrives, never copied or scanned.
    """

    def __init__(self, timestamps=False):
        self.messages = 0
        # Of the messages, those that were a publisher's last.
        self.lastMarkers = 0
        # Acknowledgements of published messages (and NATS's PONGs).
        self.acks = 0
        # Handshakes answered: CONNACK, SUBACK, Redis's subscribe replies.
        self.confirmations = 0
        # With timestamps, the latency of every stamped message, in ns.
        self.latencies = [] if timestamps else None
        self._pending = b""
        # Bytes still to come of a message already counted.
        self._skip = 0

    def feed(self, data):
        """
        Consume bytes from the broker.

        @return: the bytes to send back, often C{b""}.
        @raise BenchError: the broker refused a request.
        """
        if self._skip:
            if len(data) <= self._skip:
                self._skip -= len(data)
                return b""
            data = data[self._skip :]
            self._skip = 0
        buffer = self._pending + data if self._pending else data
        replies = []
        position = self._consumeBulk(buffer, replies)
        while (frameEnd := self._consumeFrame(buffer, position, replies)) is not None:
            position = frameEnd
        counted = min(position, len(buffer))
        self.lastMarkers += countLastMarkers(buffer, counted)
        if self.latencies is not None and counted:
            now = time.monotonic_ns()
            self.latencies.extend(
                now - int(stamp) for stamp in TIMESTAMP.findall(buffer, 0, counted)
            )
        self._skip = position - counted
        self._pending = buffer[position:]
        return b"".join(replies)

    def _consumeBulk(self, buffer, replies):
        """
        Count the frames at the start of C{buffer} at once, if they are all
        of the kinds that repeat.

        @return: where the frames counted end (0 when none were).
        """
        return 0

    def _consumeFrame(self, buffer, position, replies):
        """
        Count the frame starting at C{position}, appending any answer to
        C{replies}.

        @return: where it ends (beyond C{buffer} for a message counted
            early), or C{None} if it is incomplete (or absent).
        """
        raise NotImplementedError

    @staticmethod
    def _messageEnd(buffer, payloadStart, payloadSize, trailerSize):
        """
        Where the message whose payload starts at C{payloadStart} ends, if
        enough of it is in C{buffer} to count it; otherwise C{None}.
        """
        if payloadStart + min(payloadSize, PAYLOAD_PREFIX) > len(buffer):
            return None
        return payloadStart + payloadSize + trailerSize


# Dallal and NATS: control lines, and MSG frames whose payload size the line
# announces.

MESSAGE_VERB = b"MSG "
DELIVERY_ID = re.compile(rb" id=(\S+)")


class LineStream(Stream):
    """
    Frames that are a control line, or for C{MSG} a control line, the payload
    it announces and a line end.  A read holding nothing but messages and
    the acknowledgement lines is counted with a few C{bytes.count} scans (as
    throughput.BrokerStream does), unless the payloads are large: the scans
    read every byte, frame by frame parsing only the control lines.
    """

    # Which field of a MSG line is the payload size.
    SIZE_FIELD = None
    # The start of the lines that count as acknowledgements.
    ACK_LINE = None
    LARGEST_PAYLOAD_SCANNED = 512

    def __init__(self, timestamps=False):
        Stream.__init__(self, timestamps)
        self._largestPayload = 0

    def _completeFramesEnd(self, buffer):
        """
        Where the last complete frame of C{buffer} ends: after its last line
        end, unless that is inside a message whose payload is still coming.
        """
        end = buffer.rfind(b"\n") + 1
        header = buffer.rfind(MESSAGE_VERB, 0, end)
        if header >= 0:
            lineEnd = buffer.find(b"\n", header)
            if lineEnd + 1 + self._payloadSize(buffer[header:lineEnd]) + 2 > len(buffer):
                return header
        return end

    def _payloadSize(self, line):
        return int(line.split()[self.SIZE_FIELD])

    def _consumeBulk(self, buffer, replies):
        if self._largestPayload > self.LARGEST_PAYLOAD_SCANNED:
            return 0
        end = self._completeFramesEnd(buffer)
        messages = buffer.count(MESSAGE_VERB, 0, end)
        acks = buffer.count(self.ACK_LINE, 0, end)
        # A MSG frame holds two line ends (the payload has none), an
        # acknowledgement one: any other line end is another kind of frame.
        if buffer.count(b"\n", 0, end) != 2 * messages + acks:
            return 0
        self.messages += messages
        self.acks += acks
        if messages:
            self._acknowledgeMessages(buffer, 0, end, replies)
        return end

    def _consumeFrame(self, buffer, position, replies):
        lineEnd = buffer.find(b"\n", position)
        if lineEnd < 0:
            return None
        line = buffer[position:lineEnd].rstrip(b"\r")
        if not line.startswith(MESSAGE_VERB):
            self._controlLine(line, replies)
            return lineEnd + 1
        size = self._payloadSize(line)
        frameEnd = self._messageEnd(buffer, lineEnd + 1, size, 2)
        if frameEnd is None:
            return None
        self.messages += 1
        self._largestPayload = max(self._largestPayload, size)
        self._acknowledgeMessages(buffer, position, lineEnd, replies)
        return frameEnd

    def _acknowledgeMessages(self, buffer, start, end, replies):
        """
        Answer the messages whose control lines are between C{start} and
        C{end}, if they want it; by default, none do.
        """

    def _controlLine(self, line, replies):
        raise NotImplementedError


class DallalStream(LineStream):
    """
    Dallal (PROTOCOL.md): C{MSG <topic> <size> sub=.. seq=.. [id=..]}, acked
    with C{ACK <id>} when the subscription's mode wants it.
    """

    SIZE_FIELD = 2
    ACK_LINE = b"PUBACK "

    def __init__(self, acknowledge, timestamps=False):
        LineStream.__init__(self, timestamps)
        self.acknowledge = acknowledge

    def _acknowledgeMessages(self, buffer, start, end, replies):
        if self.acknowledge:
            deliveryIds = DELIVERY_ID.findall(buffer, start, end)
            replies.append(b"ACK " + b"\r\nACK ".join(deliveryIds) + b"\r\n")

    def _controlLine(self, line, replies):
        verb = line.split(b" ", 1)[0]
        if verb == b"PUBACK":
            self.acks += 1
        elif verb == b"SUBACK":
            self.confirmations += 1
        elif verb == b"PING":
            replies.append(b"PONG\r\n")
        elif verb != b"PONG":
            raise BenchError(f"dallal sent {line!r}")


class NatsStream(LineStream):
    """
    NATS: C{MSG <subject> <sid> [reply-to] <size>}; a C{PONG}, the answer to
    the handshake's C{PING}, counts as an acknowledgement.
    """

    SIZE_FIELD = -1
    ACK_LINE = b"PONG\r\n"

    def _controlLine(self, line, replies):
        if line == b"PONG":
            self.acks += 1
        elif line == b"PING":
            replies.append(b"PONG\r\n")
        elif not (line.startswith(b"INFO ") or line == b"+OK"):
            raise BenchError(f"nats-server sent {line!r}")


# MQTT and Redis: length-prefixed frames.


class RepeatingFrameStream(Stream):
    """
    MQTT's and Redis's frames are length-prefixed, so no count of line ends
    tells them apart.  But within a run every message a connection receives
    (or every acknowledgement a publisher receives) has the same length and
    starts with the same bytes: once the first has been parsed, a read of
    nothing else is recognised by checking, with C-speed stride slices, that
    a frame of that kind starts every that-many bytes.
    """

    MESSAGE, ACK = "message", "ack"

    def __init__(self, timestamps=False):
        Stream.__init__(self, timestamps)
        # (length, prefix, kind) of the frame that repeats, once seen.
        self._repeating = None

    def _learnRepeatingFrame(self, start, end, prefixEnd, kind, buffer):
        if self._repeating is None:
            self._repeating = (end - start, buffer[start:prefixEnd], kind)

    def _consumeBulk(self, buffer, replies):
        if self._repeating is None:
            return 0
        length, prefix, kind = self._repeating
        frames = len(buffer) // length
        end = frames * length
        if frames == 0:
            return 0
        for offset in range(len(prefix)):
            if buffer[offset:end:length] != prefix[offset : offset + 1] * frames:
                return 0
        if kind == self.MESSAGE:
            self.messages += frames
            self._acknowledgeRepeatedMessages(buffer, frames, length, replies)
        else:
            self.acks += frames
        return end

    def _acknowledgeRepeatedMessages(self, buffer, frames, length, replies):
        """
        Answer the C{frames} messages of C{length} bytes at the start of
        C{buffer} that need it; by default, none do.
        """


MQTT_PROTOCOL_LEVEL = 4  # 3.1.1
MQTT_CLEAN_SESSION = 0x02
MQTT_CONNECT, MQTT_CONNACK, MQTT_PUBLISH, MQTT_PUBACK = 1, 2, 3, 4
MQTT_SUBSCRIBE, MQTT_SUBACK = 8, 9
MQTT_SUBACK_FAILURE = 0x80
# Packet ids run from 1 to this.
MQTT_PACKET_IDS = 65535


def mqttRemainingLength(length):
    encoded = bytearray()
    while True:
        length, digit = divmod(length, 128)
        encoded.append(digit | (0x80 if length else 0))
        if not length:
            return bytes(encoded)


def mqttString(value):
    return struct.pack("!H", len(value)) + value


def mqttPacket(packetType, flags, body):
    return bytes([packetType << 4 | flags]) + mqttRemainingLength(len(body)) + body


# A PUBACK is this, then the packet id it acknowledges.
MQTT_PUBACK_HEADER = bytes([MQTT_PUBACK << 4, 2])


def mqttPuback(packetId):
    return MQTT_PUBACK_HEADER + packetId


class MqttStream(RepeatingFrameStream):
    """
    MQTT 3.1.1 packets: a PUBLISH is counted as a message (and acked with a
    PUBACK at QoS 1); a PUBACK counts as an acknowledgement.
    """

    def _consumeFrame(self, buffer, position, replies):
        length, shift, bodyStart = 0, 0, position + 1
        while True:
            if bodyStart >= len(buffer):
                return None
            digit = buffer[bodyStart]
            bodyStart += 1
            length |= (digit & 0x7F) << shift
            if digit < 0x80:
                break
            shift += 7
        end = bodyStart + length
        header = buffer[position]
        packetType, qos = header >> 4, (header >> 1) & 3
        if packetType == MQTT_PUBLISH:
            return self._publish(buffer, position, bodyStart, end, qos, replies)
        if end > len(buffer):
            return None
        if packetType == MQTT_PUBACK:
            self.acks += 1
            self._learnRepeatingFrame(position, end, end - 2, self.ACK, buffer)
        elif packetType == MQTT_CONNACK:
            if buffer[bodyStart + 1] != 0:
                raise BenchError(
                    f"the MQTT broker refused the connection: {buffer[position:end]!r}"
                )
            self.confirmations += 1
        elif packetType == MQTT_SUBACK:
            if MQTT_SUBACK_FAILURE in buffer[bodyStart + 2 : end]:
                raise BenchError(
                    f"the MQTT broker refused a subscription: {buffer[position:end]!r}"
                )
            self.confirmations += 1
        else:
            raise BenchError(f"the MQTT broker sent {buffer[position:end]!r}")
        return end

    def _publish(self, buffer, position, bodyStart, end, qos, replies):
        if bodyStart + 2 > len(buffer):
            return None
        (topicLength,) = struct.unpack_from("!H", buffer, bodyStart)
        packetIdAt = bodyStart + 2 + topicLength
        payloadStart = packetIdAt + (2 if qos else 0)
        if self._messageEnd(buffer, payloadStart, end - payloadStart, 0) is None:
            return None
        self.messages += 1
        if qos:
            replies.append(mqttPuback(buffer[packetIdAt : packetIdAt + 2]))
        # The prefix: the fixed header and the topic's length.
        self._learnRepeatingFrame(position, end, bodyStart + 2, self.MESSAGE, buffer)
        return end

    def _acknowledgeRepeatedMessages(self, buffer, frames, length, replies):
        header = buffer[0]
        if not (header >> 1) & 3:
            return
        # Every message has its packet id at the same offset: after the
        # fixed header, the topic's length and the topic.
        bodyStart = len(self._repeating[1]) - 2
        (topicLength,) = struct.unpack_from("!H", buffer, bodyStart)
        packetIdAt = bodyStart + 2 + topicLength
        end = frames * length
        pubacks = bytearray(4 * frames)
        pubacks[0::4] = MQTT_PUBACK_HEADER[:1] * frames
        pubacks[1::4] = MQTT_PUBACK_HEADER[1:] * frames
        pubacks[2::4] = buffer[packetIdAt:end:length]
        pubacks[3::4] = buffer[packetIdAt + 1 : end : length]
        replies.append(bytes(pubacks))


REDIS_MESSAGE = b"*3\r\n$7\r\nmessage\r\n"


def redisCommand(*arguments):
    return b"*%d\r\n" % len(arguments) + b"".join(
        b"$%d\r\n%s\r\n" % (len(argument), argument) for argument in arguments
    )


def parseRedisValue(buffer, position):
    """
    The RESP value at C{position}: C{(value, end)}, or C{None} if it is
    incomplete.  Bulk strings and arrays are parsed; integers and simple
    strings are returned as their text.
    """
    lineEnd = buffer.find(b"\r\n", position)
    if lineEnd < 0:
        return None
    kind, text = buffer[position : position + 1], buffer[position + 1 : lineEnd]
    if kind == b"$":
        end = lineEnd + 2 + int(text) + 2
        return (buffer[lineEnd + 2 : end - 2], end) if end <= len(buffer) else None
    if kind == b"*":
        items, end = [], lineEnd + 2
        for _ in range(int(text)):
            parsed = parseRedisValue(buffer, end)
            if parsed is None:
                return None
            item, end = parsed
            items.append(item)
        return items, end
    if kind in (b":", b"+"):
        return text, lineEnd + 2
    raise BenchError(f"redis-server sent {buffer[position:lineEnd]!r}")


class RedisStream(RepeatingFrameStream):
    """
    RESP2: a C{message} push is counted as a message, a C{subscribe} push as
    a confirmation, an integer (PUBLISH's answer) as an acknowledgement.
    """

    def _consumeFrame(self, buffer, position, replies):
        if buffer.startswith(REDIS_MESSAGE, position):
            return self._message(buffer, position)
        parsed = parseRedisValue(buffer, position)
        if parsed is None:
            return None
        value, end = parsed
        if isinstance(value, list) and value[0] == b"subscribe":
            self.confirmations += 1
        elif buffer[position : position + 1] == b":":
            self.acks += 1
            self._learnRepeatingFrame(position, end, position + 1, self.ACK, buffer)
        else:
            raise BenchError(f"redis-server sent {buffer[position:end]!r}")
        return end

    def _message(self, buffer, position):
        """
        A C{message} push: the channel, then the payload, as bulk strings.
        """
        channel = parseRedisValue(buffer, position + len(REDIS_MESSAGE))
        if channel is None:
            return None
        sizeLineEnd = buffer.find(b"\r\n", channel[1])
        if sizeLineEnd < 0:
            return None
        size = int(buffer[channel[1] + 1 : sizeLineEnd])
        end = self._messageEnd(buffer, sizeLineEnd + 2, size, 2)
        if end is None:
            return None
        self.messages += 1
        self._learnRepeatingFrame(
            position, end, position + len(REDIS_MESSAGE), self.MESSAGE, buffer
        )
        return end


# The clients: what each protocol sends.


class DallalClient:
    """
    PROTOCOL.md: C{SUB <id> <topic> mode=<mode>}, C{PUB <id> <topic> <size>},
    each PUB acknowledged by a C{PUBACK}.
    """

    def __init__(self, mode):
        self.mode = mode

    def stream(self, timestamps=False):
        return DallalStream(acknowledge=self.mode != "fire", timestamps=timestamps)

    def subscribe(self, connection, topics):
        return b"".join(
            b"SUB s%d-%d %s mode=%s\r\n" % (connection, number, topic, self.mode.encode())
            for number, topic in enumerate(topics)
        )

    def subscribed(self, stream, topics):
        return stream.confirmations == len(topics)

    def hello(self, connection):
        return b""

    def welcomed(self, stream):
        return True

    def publish(self, topic, payload, number):
        return b"PUB %d %s %d\r\n%s\r\n" % (number, topic, len(payload), payload)


class MqttClient:
    """
    MQTT 3.1.1 at QoS 0 or 1, clean sessions, keepalive off.
    """

    def __init__(self, qos):
        self.qos = qos

    def stream(self, timestamps=False):
        return MqttStream(timestamps)

    @staticmethod
    def _connect(clientId):
        body = (
            mqttString(b"MQTT")
            + bytes([MQTT_PROTOCOL_LEVEL, MQTT_CLEAN_SESSION])
            + struct.pack("!H", 0)  # keepalive off: no PINGREQ needed
            + mqttString(clientId)
        )
        return mqttPacket(MQTT_CONNECT, 0, body)

    def subscribe(self, connection, topics):
        filters = b"".join(mqttString(topic) + bytes([self.qos]) for topic in topics)
        # SUBSCRIBE's fixed header flags are 0010 (MQTT 3.1.1, 3.8.1).
        return self._connect(b"bench-sub-%d" % connection) + mqttPacket(
            MQTT_SUBSCRIBE, 0x02, struct.pack("!H", 1) + filters
        )

    def subscribed(self, stream, topics):
        return stream.confirmations == 2  # CONNACK and SUBACK

    def hello(self, connection):
        return self._connect(b"bench-pub-%d" % connection)

    def welcomed(self, stream):
        return stream.confirmations == 1

    def publish(self, topic, payload, number):
        if self.qos == 0:
            return mqttPacket(MQTT_PUBLISH, 0, mqttString(topic) + payload)
        packetId = struct.pack("!H", number % MQTT_PACKET_IDS + 1)  # 0 is not an id
        return mqttPacket(MQTT_PUBLISH, self.qos << 1, mqttString(topic) + packetId + payload)


class RedisClient:
    """
    Redis pub/sub in RESP2: SUBSCRIBE, and PUBLISH, answered with the
    number of subscribers reached.
    """

    def stream(self, timestamps=False):
        return RedisStream(timestamps)

    def subscribe(self, connection, topics):
        return redisCommand(b"SUBSCRIBE", *topics)

    def subscribed(self, stream, topics):
        return stream.confirmations == len(topics)

    def hello(self, connection):
        return b""

    def welcomed(self, stream):
        return True

    def publish(self, topic, payload, number):
        return redisCommand(b"PUBLISH", topic, payload)


class NatsClient:
    """
    NATS core: C{CONNECT {"verbose":false}}, C{SUB}, C{PUB} (unanswered);
    C{PING} after the handshake, whose C{PONG} says it is done.
    """

    CONNECT = b'CONNECT {"verbose":false,"pedantic":false}\r\n'
    # Subscription ids of one width, so that every MSG line of a run has the
    # same length whatever its topic.
    FIRST_SID = 100

    def stream(self, timestamps=False):
        return NatsStream(timestamps)

    def subscribe(self, connection, topics):
        subscriptions = b"".join(
            b"SUB %s %d\r\n" % (topic, self.FIRST_SID + number)
            for number, topic in enumerate(topics)
        )
        # The PONG to this PING says the subscriptions are in place.
        return self.CONNECT + subscriptions + b"PING\r\n"

    def subscribed(self, stream, topics):
        return stream.acks >= 1

    def hello(self, connection):
        return self.CONNECT + b"PING\r\n"

    def welcomed(self, stream):
        return stream.acks >= 1

    def publish(self, topic, payload, number):
        return b"PUB %s %d\r\n%s\r\n" % (topic, len(payload), payload)
