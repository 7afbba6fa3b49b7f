"""
Flow control, TCP against UDP, on loopback: a subscriber that stops reading
and a publisher that keeps publishing, watched with tshark and the broker's
counters.

    python3 bench/flow_control.py tcp      # modes fire and latest, 55 s each
    python3 bench/flow_control.py udp      # modes latest, all and fire, 20 s each
    python3 bench/flow_control.py tcp --modes fire --seconds 20 --plots docs

Each mode starts a fresh broker (`twistd -n dallal` on free loopback ports),
starts `tshark -i lo` with a capture filter on the broker's port, then:

- tcp: a subscriber on a raw socket with a small SO_RCVBUF (set before
  connecting, so that the window it advertises is small from the SYN on)
  sends `SUB 1 flow-control-tcp mode=<mode>`, reads its SUBACK and never
  reads again (it does not answer PINGs either);
- udp: a subscriber on a UDP socket with a small SO_RCVBUF says HELLO, gets
  its token, starts its session, sends `SUB 1 flow-control-udp mode=<mode>
  client=... token=...`, reads its SUBACK and never reads again; it keeps
  sending PINGs (writing needs no reading) so that the broker does not
  expire it;

and a TCP publisher publishes --payload bytes on the topic --rate times a
second (reading its PUBACKs).  Every --sample seconds the script records the
broker's counters (a STATS request on a connection of its own: the JSON
`dallal stats --json` prints), its VmRSS, and what the kernel holds: the
send and receive queues of both ends from /proc/net/tcp, or for UDP the
subscriber socket's queue and drops from /proc/net/udp and the machine's
UdpRcvbufErrors from /proc/net/snmp; and for both, what the kernel holds of
the publisher's connection, which the broker stops reading while a full
queue holds the publisher back.  Afterwards it reads the capture with
tshark (the window the subscriber advertised, zero-window segments and
probes, or the datagrams sent and their redeliveries; and when the broker
advertised the publisher a zero window), writes summary.json, summary.md,
the samples, the capture, and one PNG per run.

bench/README.md describes the output; docs/FLOW-CONTROL.md has the figures.
"""

import argparse
import base64
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from brokerproc import BenchError, Broker, ControlConnection  # noqa: E402

TCP_TOPIC = b"flow-control-tcp"
UDP_TOPIC = b"flow-control-udp"
SIOCINQ = 0x541B  # FIONREAD: bytes waiting in a socket's receive queue


def log(message):
    print(message, flush=True)


# What the kernel says.


def _hexAddress(text):
    address, port = text.split(":")
    return socket.inet_ntoa(struct.pack("<I", int(address, 16))), int(port, 16)


def procSockets(kind):
    """
    /proc/net/tcp or udp as a list of dicts: local, remote, tx_queue,
    rx_queue, state, and (udp) drops.
    """
    entries = []
    with open(f"/proc/net/{kind}") as table:
        next(table)
        for line in table:
            fields = line.split()
            tx, rx = fields[4].split(":")
            entry = {
                "local": _hexAddress(fields[1]),
                "remote": _hexAddress(fields[2]),
                "state": int(fields[3], 16),
                "tx_queue": int(tx, 16),
                "rx_queue": int(rx, 16),
                "inode": int(fields[9]),
            }
            if kind == "udp":
                entry["drops"] = int(fields[-1])
            entries.append(entry)
    return entries


def snmpUdp():
    with open("/proc/net/snmp") as snmp:
        lines = [line.split() for line in snmp if line.startswith("Udp:")]
    return {name: int(value) for name, value in zip(lines[0][1:], lines[1][1:])}


def pendingBytes(sock):
    import fcntl

    return struct.unpack("i", fcntl.ioctl(sock.fileno(), SIOCINQ, b"\0\0\0\0"))[0]


# tshark


class Capture:
    """
    C{tshark -i lo -f <filter> -w <file>} for the duration of a run.
    """

    def __init__(self, path, captureFilter, snaplen):
        self.path = path
        self.stderrPath = path + ".stderr"
        self.command = [
            "tshark",
            "-i",
            "lo",
            "-f",
            captureFilter,
            "-s",
            str(snaplen),
            "-w",
            path,
            "-q",
        ]
        self._stderr = open(self.stderrPath, "wb")
        self.process = subprocess.Popen(
            self.command, stdout=subprocess.DEVNULL, stderr=self._stderr
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BenchError(f"tshark exited: {open(self.stderrPath).read()}")
            with open(self.stderrPath, "rb") as stderr:
                if b"Capturing on" in stderr.read():
                    # dumpcap says so just before it starts reading packets.
                    time.sleep(0.5)
                    return
            time.sleep(0.1)
        self.stop()
        raise BenchError("tshark did not start capturing in time")

    def stop(self):
        if self.process.poll() is None:
            time.sleep(0.3)
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._stderr.close()


def tsharkFields(path, displayFilter, fields):
    command = [
        "tshark",
        "-r",
        path,
        "-Y",
        displayFilter,
        "-T",
        "fields",
        "-E",
        "separator=|",
        "-E",
        "occurrence=f",
    ]
    for field in fields:
        command += ["-e", field]
    output = subprocess.run(command, capture_output=True, check=True, timeout=300).stdout
    rows = []
    for line in output.decode("utf-8", "replace").splitlines():
        values = line.split("|")
        rows.append(dict(zip(fields, values)))
    return command, rows


# Clients


class Publisher:
    """
    Publishes on a topic at a steady rate over TCP, reading PUBACKs and
    answering PINGs so that its own connection never backs up.  When the
    broker holds it back (stops reading its connection) and its socket
    takes no more, what it publishes meanwhile waits in C{unwritten}, as
    in a client library's buffer, and goes out once the socket drains.
    """

    def __init__(self, port, topic, payload, rate):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.topic = topic
        self.payload = payload
        self.rate = rate
        self.sent = 0
        self.acked = 0
        self.started = None
        self._buffer = b""
        self._output = bytearray()

    @property
    def unwritten(self):
        """
        Bytes published that the socket has not taken yet.
        """
        return len(self._output)

    def step(self, now):
        if self.started is None:
            self.started = now
        due = int((now - self.started) * self.rate) + 1
        while self.sent < due:
            self.sent += 1
            self._output += b"PUB %d %s %d\r\n%s\r\n" % (
                self.sent,
                self.topic,
                len(self.payload),
                self.payload,
            )
        self._write()
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    raise BenchError("the broker closed the publisher's connection")
                self._buffer += data
        except (BlockingIOError, InterruptedError):
            pass
        lines = self._buffer.split(b"\n")
        self._buffer = lines.pop()
        for line in lines:
            if line.startswith(b"PUBACK"):
                self.acked += 1
            elif line.startswith(b"PING"):
                self._output += b"PONG\r\n"
            elif line.startswith(b"ERR"):
                raise BenchError(f"the broker refused a publish: {line!r}")
        self._write()

    def _write(self):
        # A non-blocking sendall() would give up midway through a frame
        # when the socket is full; send() says how much it took.
        while self._output:
            try:
                written = self.sock.send(self._output)
            except (BlockingIOError, InterruptedError):
                return
            del self._output[:written]

    def close(self):
        self.sock.close()


def readUntil(sock, needle, timeout):
    sock.settimeout(timeout)
    data = b""
    while needle not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise BenchError("the broker closed the subscriber's connection")
        data += chunk
    return data


class TcpSubscriber:
    def __init__(self, port, mode, rcvbuf):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # Before connect(): the window scale is chosen from the buffer in
        # the SYN, and the window advertised follows it.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.rcvbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self.sock.connect(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.sock.sendall(b"SUB 1 %s mode=%s\r\n" % (TCP_TOPIC, mode.encode()))
        # Read exactly up to the SUBACK line (one recv may hold more; here
        # nothing else has been published yet), then never again.
        readUntil(self.sock, b"SUBACK 1\r\n", 10)

    def close(self):
        self.sock.close()


class UdpSubscriber:
    """
    A UDP client that says HELLO, subscribes, and then never reads; it
    pings the broker now and then (sending needs no reading).
    """

    def __init__(self, port, mode, rcvbuf):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.rcvbuf = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.connect(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.clientId = base64.urlsafe_b64encode(os.urandom(12)).decode()
        hello = f"HELLO 1 {self.clientId} pad={'x' * 32}".encode()
        reply = self._ask(hello, b"HELLO 1 ")
        self.token = dict(option.split("=", 1) for option in reply.split()[2:] if "=" in option)[
            "token"
        ]
        identity = f"client={self.clientId} token={self.token}".encode()
        self.identity = identity
        reply = self._ask(
            b"HELLO 2 %s token=%s" % (self.clientId.encode(), self.token.encode()), b"HELLO 2 "
        )
        if "session=new" not in reply:
            raise BenchError(f"unexpected HELLO answer {reply!r}")
        self._ask(b"SUB 3 %s mode=%s %s" % (UDP_TOPIC, mode.encode(), identity), b"SUBACK 3")
        self.pings = 0

    def _ask(self, request, answer):
        """
        Send a request until its answer comes (UDP may lose either).
        """
        self.sock.settimeout(0.5)
        for _ in range(20):
            self.sock.send(request)
            try:
                while True:
                    data = self.sock.recv(65536)
                    if data.startswith(answer):
                        return data.decode("ascii", "replace").split("\r\n", 1)[0]
                    if data.startswith(b"ERR"):
                        raise BenchError(f"the broker refused {request!r}: {data!r}")
            except TimeoutError:
                continue
        raise BenchError(f"no answer to {request!r}")

    def ping(self):
        self.pings += 1
        self.sock.send(b"PING %s" % self.identity)

    def close(self):
        try:
            self.sock.send(b"BYE %s" % self.identity)
        except OSError:
            pass
        self.sock.close()


# One run


def rss(broker):
    try:
        return broker.residentMemory()
    except (OSError, BenchError):
        return None


def runMode(transport, mode, options, outDirectory):
    directory = tempfile.mkdtemp(prefix=f"dallal-flow-{transport}-")
    extra = ["--ping-interval", f"{options.ping_interval:g}"]
    broker = Broker(directory, extra=extra, udp=transport == "udp")
    port = broker.udpPort if transport == "udp" else broker.port
    pcap = os.path.join(outDirectory, f"{transport}-{mode}.pcapng")
    # Over UDP, the publisher's TCP connection too: it is what the broker
    # holds back.
    captureFilter = f"{transport} port {port}"
    if transport == "udp":
        captureFilter += f" or tcp port {broker.port}"
    capture = None
    samples = []
    clients = []
    info = {
        "transport": transport,
        "mode": mode,
        "broker_command": broker.reproduce(),
        "broker_port": broker.port,
        "udp_port": broker.udpPort,
        "capture_filter": captureFilter,
        "pcap": pcap,
    }
    try:
        capture = Capture(pcap, captureFilter, options.snaplen)
        info["tshark_command"] = shlex.join(capture.command)
        control = ControlConnection(broker.port)
        clients.append(control.sock)
        if transport == "tcp":
            subscriber = TcpSubscriber(broker.port, mode, options.rcvbuf)
        else:
            subscriber = UdpSubscriber(broker.udpPort, mode, options.rcvbuf)
        clients.append(subscriber.sock)
        info["subscriber_port"] = subscriber.port
        info["subscriber_rcvbuf"] = subscriber.rcvbuf
        topic = TCP_TOPIC if transport == "tcp" else UDP_TOPIC
        publisher = Publisher(broker.port, topic, b"m" * options.payload, options.rate)
        clients.append(publisher.sock)
        info["publisher_port"] = publisher.port
        snmpBefore = snmpUdp()
        started = time.time()
        info["started"] = started
        nextSample = 0.0
        nextPing = options.ping_interval / 2
        log(
            f"{transport} {mode}: broker pid {broker.pid}, port {port}; subscriber port "
            f"{subscriber.port} (SO_RCVBUF {subscriber.rcvbuf}); publishing "
            f"{options.payload}-byte messages {options.rate:g}/s for {options.seconds:g} s"
        )
        while True:
            elapsed = time.time() - started
            if elapsed >= options.seconds:
                break
            publisher.step(time.monotonic())
            if transport == "udp" and elapsed >= nextPing:
                nextPing += options.ping_interval / 2
                subscriber.ping()
            if elapsed >= nextSample:
                nextSample += options.sample
                samples.append(
                    sample(transport, broker, control, subscriber, publisher, elapsed, snmpBefore)
                )
            time.sleep(0.005)
        publisher.step(time.monotonic())
        time.sleep(0.2)
        last, info["stats_end"] = settledSample(
            transport, broker, control, subscriber, publisher, started, snmpBefore
        )
        samples.append(last)
        info["ended"] = last["t"]
        info["published"] = publisher.sent
        info["publisher_unwritten_end"] = publisher.unwritten
        info["pubacks"] = publisher.acked
        info["udp_pings_sent"] = getattr(subscriber, "pings", None)
        info["rss_end"] = rss(broker)
        info["vmhwm"] = broker.peakMemory()
        info["log_tail"] = [
            line
            for line in logLines(broker)
            if "event=ping_missed" in line
            or "event=client_dropped" in line
            or "event=disconnect" in line
            or "event=slow_consumer" in line
        ]
        # The reference: what `dallal stats --json` prints now.
        cli = subprocess.run(
            [sys.executable, "-m", "dallal", "127.0.0.1", str(broker.port), "stats", "--json"],
            capture_output=True,
            timeout=60,
        )
        info["dallal_stats_json"] = cli.stdout.decode("utf-8", "replace").strip()
        publisher.close()
        subscriber.close()
        control.close()
    finally:
        for sock in clients:
            try:
                sock.close()
            except OSError:
                pass
        broker.stop()
        if capture is not None:
            capture.stop()
        shutil.rmtree(directory, ignore_errors=True)
    return info, samples


def logLines(broker):
    lines = []
    for name in sorted(os.listdir(os.path.dirname(broker.logPath))):
        if name.startswith("twistd.log"):
            with open(
                os.path.join(os.path.dirname(broker.logPath), name),
                encoding="utf-8",
                errors="replace",
            ) as log_:
                lines += log_.read().splitlines()
    return lines


def settledSample(transport, broker, control, subscriber, publisher, started, snmpBefore):
    """
    The last sample and the broker's counters, taken while the broker sent
    nothing (over UDP in mode all it resends its window every second), so
    that its counters, the kernel's and the capture up to the sample's time
    agree.
    """
    sending = ("delivered", "redelivered", "fired", "dropped", "replaced")
    for _ in range(40):
        point = sample(
            transport, broker, control, subscriber, publisher, time.time() - started, snmpBefore
        )
        stats = control.stats()
        point["t"] = round(time.time() - started, 3)
        if all(stats.get(name) == point[name] for name in sending):
            return point, stats
        time.sleep(0.05)
    raise BenchError("the broker never stopped sending for long enough to read its counters")


def sample(transport, broker, control, subscriber, publisher, elapsed, snmpBefore):
    stats = control.stats()
    point = {
        "t": round(elapsed, 3),
        "rss": rss(broker),
        "published": publisher.sent,
        "pubacks": publisher.acked,
        "publisher_unwritten": publisher.unwritten,
    }
    for name in (
        "matched",
        "delivered",
        "fired",
        "redelivered",
        "acked",
        "replaced",
        "dropped",
        "inflight",
        "dropped_queue_full",
        "dropped_superseded",
        "dropped_redelivery_limit",
        "dropped_disconnected",
        "dropped_slow_consumer",
        "publishers_paused",
        "publishers_held",
        "publishes_busy",
        "slow_consumers",
        "pings_missed",
        "clients_dropped",
        "connections",
        "unsent",
        "bytes_out",
    ):
        point[name] = stats.get(name)
    tcpSockets = procSockets("tcp")
    # The publisher's connection: what the broker has not read of it, and
    # what its kernel has not sent.
    publisherEnd, brokerEnd = connectionEnds(tcpSockets, publisher.port, broker.port)
    point["broker_rx_queue_from_publisher"] = brokerEnd["rx_queue"] if brokerEnd else None
    point["publisher_tx_queue"] = publisherEnd["tx_queue"] if publisherEnd else None
    if transport == "tcp":
        subscriberEnd, brokerEnd = connectionEnds(tcpSockets, subscriber.port, broker.port)
        point["subscriber_rx_queue"] = subscriberEnd["rx_queue"] if subscriberEnd else None
        point["broker_tx_queue"] = brokerEnd["tx_queue"] if brokerEnd else None
        point["broker_socket_state"] = brokerEnd["state"] if brokerEnd else None
    else:
        mine = [entry for entry in procSockets("udp") if entry["local"][1] == subscriber.port]
        point["subscriber_rx_queue"] = mine[0]["rx_queue"] if mine else None
        point["subscriber_drops"] = mine[0]["drops"] if mine else None
        snmp = snmpUdp()
        for name in ("RcvbufErrors", "InDatagrams", "InErrors", "SndbufErrors"):
            point["udp_" + name] = snmp.get(name, 0) - snmpBefore.get(name, 0)
    return point


def connectionEnds(entries, clientPort, brokerPort):
    """
    The client's and the broker's ends of a loopback TCP connection, as
    procSockets("tcp") lists them (None for an end that is gone).
    """
    clientEnd = brokerEnd = None
    for entry in entries:
        if entry["local"][1] == clientPort and entry["remote"][1] == brokerPort:
            clientEnd = entry
        elif entry["local"][1] == brokerPort and entry["remote"][1] == clientPort:
            brokerEnd = entry
    return clientEnd, brokerEnd


# Reading the captures


def flag(row, field):
    return bool(row.get(field))


def isSyn(row):
    return row["tcp.flags.syn"] in ("1", "True")


def isWindowProbe(row):
    """
    A zero-window probe: tshark calls Linux's (an empty segment one byte
    behind the window) keep-alives.
    """
    return flag(row, "tcp.analysis.zero_window_probe") or flag(row, "tcp.analysis.keep_alive")


def analyseTcp(info):
    fields = [
        "frame.time_epoch",
        "tcp.srcport",
        "tcp.dstport",
        "tcp.len",
        "tcp.seq",
        "tcp.ack",
        "tcp.window_size",
        "tcp.window_size_value",
        "tcp.window_size_scalefactor",
        "tcp.flags.syn",
        "tcp.flags.reset",
        "tcp.flags.fin",
        "tcp.analysis.zero_window",
        "tcp.analysis.zero_window_probe",
        "tcp.analysis.zero_window_probe_ack",
        "tcp.analysis.keep_alive",
        "tcp.analysis.keep_alive_ack",
        "tcp.analysis.window_full",
        "tcp.analysis.window_update",
        "tcp.analysis.bytes_in_flight",
    ]
    sport = info["subscriber_port"]
    command, rows = tsharkFields(info["pcap"], f"tcp.port == {sport}", fields)
    started = info["started"]
    fromSubscriber, fromBroker = [], []
    for row in rows:
        row["t"] = float(row["frame.time_epoch"]) - started
        (fromSubscriber if int(row["tcp.srcport"]) == sport else fromBroker).append(row)
    windows = [
        (row["t"], int(row["tcp.window_size"] or 0)) for row in fromSubscriber if not isSyn(row)
    ]
    zeroWindows = [row["t"] for row in fromSubscriber if flag(row, "tcp.analysis.zero_window")]
    probes = [row["t"] for row in fromBroker if isWindowProbe(row)]
    zwProbesOnly = sum(flag(row, "tcp.analysis.zero_window_probe") for row in fromBroker)
    keepAliveProbes = sum(flag(row, "tcp.analysis.keep_alive") for row in fromBroker)
    probeAcks = sum(
        flag(row, "tcp.analysis.zero_window_probe_ack") or flag(row, "tcp.analysis.keep_alive_ack")
        for row in fromSubscriber
    )
    dataSegments = [row for row in fromBroker if int(row["tcp.len"] or 0) > 0]
    payloadBytes = sum(int(row["tcp.len"]) for row in dataSegments)
    windowFull = sum(flag(row, "tcp.analysis.window_full") for row in fromBroker)
    resets = [
        (row["t"], "subscriber" if int(row["tcp.srcport"]) == sport else "broker")
        for row in rows
        if row["tcp.flags.reset"] in ("1", "True")
    ]
    syn = next((row for row in fromSubscriber if isSyn(row)), None)
    lastData = dataSegments[-1]["t"] if dataSegments else None
    return {
        "tshark_read_command": shlex.join(command),
        "segments": len(rows),
        "syn_window": int(syn["tcp.window_size_value"]) if syn else None,
        "window_max": max((w for _, w in windows), default=None),
        "first_zero_window": round(zeroWindows[0], 3) if zeroWindows else None,
        "zero_window_segments": len(zeroWindows),
        "probes": len(probes),
        "probe_times": [round(t, 2) for t in probes],
        "probes_flagged_zero_window_probe": zwProbesOnly,
        "probes_flagged_keep_alive": keepAliveProbes,
        "probe_acks": probeAcks,
        "window_full": windowFull,
        "data_segments": len(dataSegments),
        "payload_bytes_to_subscriber": payloadBytes,
        "last_data_segment": round(lastData, 3) if lastData is not None else None,
        "resets": [(round(t, 3), side) for t, side in resets],
        "run_ended": info["ended"],
        "windows": [(round(t, 4), w) for t, w in windows],
    }


def analyseUdp(info):
    fields = ["frame.time_epoch", "udp.srcport", "udp.dstport", "udp.length", "data.data"]
    sport = info["subscriber_port"]
    command, rows = tsharkFields(info["pcap"], f"udp.port == {sport}", fields)
    started = info["started"]
    toSubscriber = []
    fromSubscriber = 0
    for row in rows:
        t = float(row["frame.time_epoch"]) - started
        if int(row["udp.dstport"]) != sport:
            fromSubscriber += 1
            continue
        head = bytes.fromhex(row["data.data"] or "")[:200].split(b"\r\n", 1)[0]
        verb = head.split(b" ", 1)[0]
        redelivered = b"redelivered=1" in head
        seq = None
        for option in head.split(b" "):
            if option.startswith(b"seq="):
                seq = int(option[4:])
        toSubscriber.append(
            {
                "t": t,
                "verb": verb.decode("ascii", "replace"),
                "redelivered": redelivered,
                "seq": seq,
            }
        )
    # What the broker sent until the last sample, when its counters were
    # read (it goes on resending until it stops).
    toSubscriber = [d for d in toSubscriber if d["t"] <= info["ended"]]
    messages = [d for d in toSubscriber if d["verb"] == "MSG"]
    first = [d for d in messages if not d["redelivered"]]
    again = [d for d in messages if d["redelivered"]]
    return {
        "tshark_read_command": shlex.join(command),
        "datagrams_to_subscriber": len(toSubscriber),
        "datagrams_from_subscriber": fromSubscriber,
        "msg_datagrams": len(messages),
        "msg_first_sends": len(first),
        "msg_redelivered": len(again),
        "distinct_seq_sent": len({d["seq"] for d in messages}),
        "other_datagrams": {
            verb: sum(1 for d in toSubscriber if d["verb"] == verb)
            for verb in sorted({d["verb"] for d in toSubscriber} - {"MSG"})
        },
        "sends": [(round(d["t"], 3), d["redelivered"]) for d in messages],
    }


def analysePublisher(info):
    """
    The publisher's connection in the capture: when the window the broker
    advertised to it was zero (the broker not reading it), and the probes
    the publisher's kernel sent meanwhile.
    """
    fields = [
        "frame.time_epoch",
        "tcp.srcport",
        "tcp.window_size",
        "tcp.flags.syn",
        "tcp.analysis.zero_window",
        "tcp.analysis.zero_window_probe",
        "tcp.analysis.keep_alive",
    ]
    port = info["publisher_port"]
    command, rows = tsharkFields(info["pcap"], f"tcp.port == {port}", fields)
    closed = []
    zeroWindows = probes = 0
    for row in rows:
        t = round(float(row["frame.time_epoch"]) - info["started"], 3)
        if int(row["tcp.srcport"]) == port:
            probes += isWindowProbe(row)
        elif not isSyn(row):
            zeroWindows += flag(row, "tcp.analysis.zero_window")
            if int(row["tcp.window_size"] or 0) == 0:
                if not closed or closed[-1][1] is not None:
                    closed.append([t, None])
            elif closed and closed[-1][1] is None:
                closed[-1][1] = t
    return {
        "tshark_read_command": shlex.join(command),
        "window_closed": [tuple(period) for period in closed],
        "zero_window_segments": zeroWindows,
        "probes": probes,
    }


def periods(samples, name):
    """
    The (start, end) times of the samples in which counter C{name} was not
    zero; end None if it still was at the last sample.
    """
    found = []
    for point in samples:
        if point[name]:
            if not found or found[-1][1] is not None:
                found.append([point["t"], None])
        elif found and found[-1][1] is None:
            found[-1][1] = point["t"]
    return [tuple(period) for period in found]


def eventTime(line, started):
    """
    When the broker logged an event (its C{t=} field), in seconds since
    C{started}.
    """
    for field in line.split():
        if field.startswith("t="):
            return round(float(field[2:]) - started, 3)
    return None


def firstTime(samples, name):
    return next((point["t"] for point in samples if point[name]), None)


def summariseHold(info, samples, publisherAnalysis):
    """
    How the broker held the publisher back: from its counters, the kernel's
    queues of the publisher's connection and the capture.
    """

    def largest(name):
        return max((s[name] for s in samples if s[name] is not None), default=None)

    events = [line for line in info["log_tail"] if "event=slow_consumer" in line]
    return {
        "publisher_held_s": periods(samples, "publishers_held"),
        "slow_consumer_s": eventTime(events[0], info["started"]) if events else None,
        "slow_consumer_events": events,
        "first_queue_full_drop_s": firstTime(samples, "dropped_queue_full"),
        "publisher_window_closed_s": publisherAnalysis["window_closed"],
        "publisher_zero_window_segments": publisherAnalysis["zero_window_segments"],
        "publisher_probes": publisherAnalysis["probes"],
        "broker_rx_queue_from_publisher_max": largest("broker_rx_queue_from_publisher"),
        "publisher_tx_queue_max": largest("publisher_tx_queue"),
        "publisher_unwritten_max": largest("publisher_unwritten"),
        "publisher_unwritten_end": info["publisher_unwritten_end"],
    }


# Summaries


def summariseTcp(info, samples, analysis, publisherAnalysis):
    stats = info["stats_end"]
    queue = [s["inflight"] for s in samples if s["inflight"] is not None]
    rssValues = [s["rss"] for s in samples if s["rss"]]
    txQueue = [s["broker_tx_queue"] for s in samples if s["broker_tx_queue"] is not None]
    rxQueue = [s["subscriber_rx_queue"] for s in samples if s["subscriber_rx_queue"] is not None]
    dropTime = next((s["t"] for s in samples if s["clients_dropped"]), None)
    return {
        "mode": info["mode"],
        "published": info["published"],
        "pubacks": info["pubacks"],
        "subscriber_rcvbuf": info["subscriber_rcvbuf"],
        "syn_window": analysis["syn_window"],
        "window_max": analysis["window_max"],
        "first_zero_window_s": analysis["first_zero_window"],
        "zero_window_segments": analysis["zero_window_segments"],
        "probes": analysis["probes"],
        "probe_times_s": analysis["probe_times"],
        "probes_flagged_zero_window_probe": analysis["probes_flagged_zero_window_probe"],
        "probes_flagged_keep_alive": analysis["probes_flagged_keep_alive"],
        "window_full_segments": analysis["window_full"],
        "payload_bytes_to_subscriber": analysis["payload_bytes_to_subscriber"],
        "last_data_segment_s": analysis["last_data_segment"],
        "resets_s": analysis["resets"],
        "run_ended_s": info["ended"],
        "subscriber_rx_queue_max": max(rxQueue, default=None),
        "broker_tx_queue_max": max(txQueue, default=None),
        "broker_queue_max": max(queue, default=None),
        "subscriber_dropped_for_missed_pings_s": dropTime,
        "rss_min": min(rssValues, default=None),
        "rss_max": max(rssValues, default=None),
        "vmhwm": info["vmhwm"],
        "counters": {
            name: stats.get(name)
            for name in (
                "published",
                "matched",
                "delivered",
                "fired",
                "redelivered",
                "acked",
                "replaced",
                "dropped",
                "dropped_queue_full",
                "dropped_superseded",
                "dropped_redelivery_limit",
                "dropped_disconnected",
                "dropped_slow_consumer",
                "publishers_paused",
                "publishes_busy",
                "slow_consumers",
                "inflight",
                "pings_missed",
                "clients_dropped",
            )
        },
        "events": info["log_tail"][-6:],
        **summariseHold(info, samples, publisherAnalysis),
    }


def summariseUdp(info, samples, analysis, publisherAnalysis):
    stats = info["stats_end"]
    last = samples[-1]
    return {
        "mode": info["mode"],
        "published": info["published"],
        "pubacks": info["pubacks"],
        "subscriber_rcvbuf": info["subscriber_rcvbuf"],
        "udp_pings_sent": info["udp_pings_sent"],
        "datagrams_to_subscriber_captured": analysis["datagrams_to_subscriber"],
        "msg_datagrams_captured": analysis["msg_datagrams"],
        "msg_first_sends_captured": analysis["msg_first_sends"],
        "msg_redelivered_captured": analysis["msg_redelivered"],
        "distinct_seq_sent": analysis["distinct_seq_sent"],
        "other_datagrams_to_subscriber": analysis["other_datagrams"],
        "subscriber_socket_drops": last["subscriber_drops"],
        "subscriber_rx_queue_end": last["subscriber_rx_queue"],
        "machine_udp_rcvbuf_errors": last["udp_RcvbufErrors"],
        "machine_udp_in_datagrams": last["udp_InDatagrams"],
        "rss_min": min((s["rss"] for s in samples if s["rss"]), default=None),
        "rss_max": max((s["rss"] for s in samples if s["rss"]), default=None),
        "broker_queue_max": max((s["inflight"] for s in samples), default=None),
        "counters": {
            name: stats.get(name)
            for name in (
                "published",
                "matched",
                "delivered",
                "fired",
                "redelivered",
                "acked",
                "replaced",
                "dropped",
                "dropped_queue_full",
                "dropped_superseded",
                "dropped_redelivery_limit",
                "dropped_disconnected",
                "dropped_slow_consumer",
                "publishers_paused",
                "publishes_busy",
                "slow_consumers",
                "inflight",
                "unsent",
                "pings_missed",
                "clients_dropped",
            )
        },
        "events": info["log_tail"][-6:],
        **summariseHold(info, samples, publisherAnalysis),
    }


def describeTcp(summary):
    c = summary["counters"]
    lines = [
        f"mode {summary['mode']}: {summary['published']:,} published, "
        f"{summary['pubacks']:,} PUBACKs",
        f"  subscriber SO_RCVBUF {summary['subscriber_rcvbuf']:,} B; window in its SYN "
        f"{summary['syn_window']}, largest advertised {summary['window_max']}; first zero "
        f"window at {summary['first_zero_window_s']} s, {summary['zero_window_segments']} "
        f"zero-window segments",
        f"  probes from the broker's kernel: {summary['probes']} at {summary['probe_times_s']} s "
        f"(tshark flags {summary['probes_flagged_zero_window_probe']} zero_window_probe, "
        f"{summary['probes_flagged_keep_alive']} keep_alive); window_full "
        f"{summary['window_full_segments']}",
        f"  payload bytes that reached the subscriber's socket {summary['payload_bytes_to_subscriber']:,}"
        f" (the last data segment at {summary['last_data_segment_s']} s); its receive queue "
        f"held at most {summary['subscriber_rx_queue_max']}, the broker's kernel send queue "
        f"{summary['broker_tx_queue_max']}",
        f"  broker: queue (inflight) at most {summary['broker_queue_max']}, first queue_full "
        f"drop at {summary['first_queue_full_drop_s']} s, subscriber dropped for missed pings "
        f"at {summary['subscriber_dropped_for_missed_pings_s']} s (RSTs in the capture, time "
        f"and sender: {summary['resets_s']}; the run ended at {summary['run_ended_s']} s); RSS {mib(summary['rss_min'])}-{mib(summary['rss_max'])}",
        *describeHold(summary),
        "  counters: " + ", ".join(f"{k} {v:,}" for k, v in c.items() if v is not None),
    ]
    return lines


def describeUdp(summary):
    c = summary["counters"]
    return [
        f"mode {summary['mode']}: {summary['published']:,} published, "
        f"{summary['pubacks']:,} PUBACKs; subscriber SO_RCVBUF {summary['subscriber_rcvbuf']:,} B",
        f"  capture: {summary['msg_datagrams_captured']:,} MSG datagrams to the subscriber "
        f"({summary['msg_first_sends_captured']:,} first sends, "
        f"{summary['msg_redelivered_captured']:,} redelivered, "
        f"{summary['distinct_seq_sent']:,} distinct seq), other "
        f"{summary['other_datagrams_to_subscriber']}",
        f"  kernel: {summary['subscriber_socket_drops']:,} dropped at the subscriber's socket "
        f"(/proc/net/udp drops), {summary['subscriber_rx_queue_end']:,} B left in its queue; "
        f"the machine's UdpRcvbufErrors +{summary['machine_udp_rcvbuf_errors']:,}",
        f"  broker: queue (inflight) at most {summary['broker_queue_max']}; RSS "
        f"{mib(summary['rss_min'])}-{mib(summary['rss_max'])}, first queue_full drop at "
        f"{summary['first_queue_full_drop_s']} s",
        *describeHold(summary),
        "  counters: " + ", ".join(f"{k} {v:,}" for k, v in c.items() if v is not None),
    ]


def describeHold(summary):
    return [
        f"  publisher held back (publishers_held, start and end s): "
        f"{summary['publisher_held_s']}; slow consumer at {summary['slow_consumer_s']} s "
        f"{summary['slow_consumer_events']}",
        f"  publisher's connection: zero window from the broker (start and end s) "
        f"{summary['publisher_window_closed_s']}, {summary['publisher_zero_window_segments']} "
        f"zero-window segments, {summary['publisher_probes']} probes from the publisher; "
        f"at most {summary['broker_rx_queue_from_publisher_max']} B unread in the broker's "
        f"receive queue, {summary['publisher_tx_queue_max']} B in the publisher's send "
        f"queue, {summary['publisher_unwritten_max']} B waiting in the publisher "
        f"({summary['publisher_unwritten_end']} B at the end)",
    ]


def mib(value):
    return f"{value / 2**20:.1f} MiB" if value else "?"


# Plots


def markHold(axes, samples):
    """
    Shade on C{axes} when the publisher was held back and mark when the
    subscriber was found a slow consumer (labelled on the first axis).
    """
    end = samples[-1]["t"] if samples else 0
    for index, (start, stop) in enumerate(periods(samples, "publishers_held")):
        for axis in axes:
            axis.axvspan(
                start,
                end if stop is None else stop,
                color="gold",
                alpha=0.3,
                label="publisher held back" if index == 0 and axis is axes[0] else None,
            )
    slow = firstTime(samples, "slow_consumers")
    if slow is not None:
        for axis in axes:
            axis.axvline(
                slow,
                color="tab:red",
                linestyle=":",
                linewidth=1,
                label="slow consumer" if axis is axes[0] else None,
            )


def plotTcp(mode, samples, analysis, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (top, middle, bottom) = plt.subplots(3, 1, sharex=True, figsize=(7, 6.2), dpi=80)
    windows = analysis["windows"]
    if windows:
        top.step(
            [t for t, _ in windows],
            [w for _, w in windows],
            where="post",
            color="tab:blue",
            label="window advertised by the subscriber (bytes)",
        )
    zeros = [t for t, w in windows if w == 0]
    if zeros:
        top.plot(zeros, [0] * len(zeros), "v", color="tab:red", markersize=4, label="zero window")
    probes = analysis["probe_times"]
    if probes:
        top.plot(
            probes,
            [max((w for _, w in windows), default=1) * 0.1] * len(probes),
            "|",
            color="black",
            markersize=10,
            label="broker's probes",
        )
    for reset, _ in analysis["resets"]:
        for axis in (top, middle, bottom):
            axis.axvline(reset, color="tab:gray", linestyle="--", linewidth=0.8)
    markHold([top, middle, bottom], samples)
    top.set_ylabel("bytes")
    top.legend(fontsize=7, loc="upper right")
    top.set_title(f"TCP, mode {mode}: a subscriber that stops reading", fontsize=10)
    t = [s["t"] for s in samples]
    middle.plot(
        t,
        [(s["broker_tx_queue"] or 0) / 1024 for s in samples],
        color="tab:green",
        label="broker's kernel send queue (KiB)",
    )
    middle.plot(
        t,
        [(s["subscriber_rx_queue"] or 0) / 1024 for s in samples],
        color="tab:cyan",
        label="subscriber's receive queue (KiB)",
    )
    middle.plot(
        t,
        [(s["broker_rx_queue_from_publisher"] or 0) / 1024 for s in samples],
        color="tab:olive",
        label="publisher's data the broker has not read (KiB)",
    )
    middle.set_ylabel("KiB")
    middle.legend(fontsize=7, loc="upper left")
    queue = middle.twinx()
    queue.plot(
        t,
        [s["inflight"] or 0 for s in samples],
        color="tab:orange",
        label="broker's own queue (inflight, messages)",
    )
    queue.set_ylabel("messages")
    queue.set_ylim(bottom=0, top=max(10, max(s["inflight"] or 0 for s in samples) * 1.15))
    queue.legend(fontsize=7, loc="center right")
    bottom.plot(
        t, [s["dropped"] or 0 for s in samples], color="tab:red", label="dropped (all reasons)"
    )
    bottom.plot(
        t, [s["replaced"] or 0 for s in samples], color="tab:purple", label="replaced (latest)"
    )
    bottom.plot(
        t,
        [s["fired"] or 0 for s in samples],
        color="tab:blue",
        label="fired (handed to the transport)",
    )
    bottom.plot(t, [s["pubacks"] for s in samples], color="black", linewidth=0.8, label="PUBACKs")
    bottom.set_ylabel("messages")
    bottom.legend(fontsize=7, loc="upper left")
    memory = bottom.twinx()
    memory.plot(
        t,
        [(s["rss"] or 0) / 2**20 for s in samples],
        color="tab:brown",
        linestyle="--",
        label="broker RSS (MiB)",
    )
    memory.set_ylabel("RSS (MiB)")
    memory.ticklabel_format(useOffset=False)
    values = [(s["rss"] or 0) / 2**20 for s in samples if s["rss"]]
    if values:
        memory.set_ylim(min(values) - 2, max(values) + 2)
    memory.legend(fontsize=7, loc="center right")
    bottom.set_xlabel("seconds since the publisher started")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def plotUdp(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        len(results), 1, sharex=True, figsize=(7, 2.2 * len(results) + 0.6), dpi=80
    )
    if len(results) == 1:
        axes = [axes]
    for axis, (mode, samples, analysis) in zip(axes, results):
        t = [s["t"] for s in samples]
        axis.plot(
            t,
            [s["published"] for s in samples],
            color="tab:gray",
            linestyle="--",
            label="published",
        )
        axis.plot(t, [s["pubacks"] for s in samples], color="black", linewidth=0.8, label="PUBACKs")
        sends = analysis["sends"]
        axis.plot(
            [x for x, _ in sends],
            range(1, len(sends) + 1),
            color="tab:blue",
            label="MSG datagrams sent (capture)",
        )
        axis.plot(
            t,
            [s["subscriber_drops"] or 0 for s in samples],
            color="tab:red",
            label="dropped at the subscriber's socket",
        )
        axis.plot(
            t,
            [s["redelivered"] or 0 for s in samples],
            color="tab:green",
            label="redelivered (broker)",
        )
        axis.plot(
            t,
            [s["dropped"] or 0 for s in samples],
            color="tab:orange",
            label="dropped by the broker",
        )
        axis.plot(
            t,
            [s["replaced"] or 0 for s in samples],
            color="tab:purple",
            linestyle=":",
            label="replaced (broker)",
        )
        markHold([axis], samples)
        axis.set_ylabel("datagrams / messages", fontsize=8)
        axis.set_title(f"UDP, mode {mode}", fontsize=9)
        axis.legend(fontsize=6, loc="upper left")
    axes[-1].set_xlabel("seconds since the publisher started")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


# Main


def describeSetup():
    try:
        load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        load = "unknown"
    tshark = (
        subprocess.run(["tshark", "--version"], capture_output=True, timeout=30)
        .stdout.decode()
        .splitlines()[0]
    )
    return (
        f"machine: {os.cpu_count()} cores, load average {load}; Python "
        f"{platform.python_version()}; {tshark}"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("transport", choices=["tcp", "udp"])
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=["latest", "all", "fire"],
        help="delivery modes (tcp: fire latest; udp: latest all fire)",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        help="how long each mode runs (tcp 55: long enough for the broker to drop the silent subscriber at the default --ping-interval; udp 20)",
    )
    parser.add_argument(
        "--rate", type=float, help="messages published per second (tcp 500, udp 200)"
    )
    parser.add_argument("--payload", type=int, help="payload bytes per message (tcp 1024, udp 512)")
    parser.add_argument(
        "--rcvbuf",
        type=int,
        help="the subscriber's SO_RCVBUF, before the kernel doubles it (tcp 4096, udp 16384)",
    )
    parser.add_argument(
        "--ping-interval",
        type=float,
        default=10.0,
        help="the broker's --ping-interval (10, its default)",
    )
    parser.add_argument(
        "--sample", type=float, default=0.25, help="seconds between samples of the counters (0.25)"
    )
    parser.add_argument(
        "--snaplen",
        type=int,
        default=256,
        help="bytes captured per packet (256: headers and control lines)",
    )
    parser.add_argument(
        "--out",
        help="where to write the captures and summaries (default: a new directory under /tmp)",
    )
    parser.add_argument("--plots", help="where to write the PNGs (default: --out)")
    options = parser.parse_args(argv)
    tcp = options.transport == "tcp"
    options.modes = options.modes or (["fire", "latest"] if tcp else ["latest", "all", "fire"])
    options.seconds = options.seconds or (55.0 if tcp else 20.0)
    options.rcvbuf = options.rcvbuf or (4096 if tcp else 16384)
    options.rate = options.rate or (500.0 if tcp else 200.0)
    options.payload = options.payload or (1024 if tcp else 512)
    if shutil.which("tshark") is None:
        print("flow_control.py: tshark is not installed (apt-get install tshark)", file=sys.stderr)
        return 1
    out = options.out or tempfile.mkdtemp(prefix=f"dallal-flow-control-{options.transport}-")
    os.makedirs(out, exist_ok=True)
    plots = options.plots or out
    os.makedirs(plots, exist_ok=True)
    log(describeSetup())
    summaries, lines, udpPlots = [], [], []
    try:
        for mode in options.modes:
            info, samples = runMode(options.transport, mode, options, out)
            publisherAnalysis = analysePublisher(info)
            if tcp:
                analysis = analyseTcp(info)
                summary = summariseTcp(info, samples, analysis, publisherAnalysis)
                text = describeTcp(summary)
                png = os.path.join(plots, f"flow-control-tcp-{mode}.png")
                plotTcp(mode, samples, analysis, png)
                summary["plot"] = png
            else:
                analysis = analyseUdp(info)
                summary = summariseUdp(info, samples, analysis, publisherAnalysis)
                text = describeUdp(summary)
                udpPlots.append((mode, samples, analysis))
            summary["commands"] = {
                "broker": info["broker_command"],
                "tshark": info.get("tshark_command"),
                "tshark_read": analysis["tshark_read_command"],
                "tshark_read_publisher": publisherAnalysis["tshark_read_command"],
            }
            summary["dallal_stats_json"] = info["dallal_stats_json"]
            summaries.append(summary)
            with open(os.path.join(out, f"{options.transport}-{mode}-samples.json"), "w") as f:
                json.dump(
                    {
                        "info": {k: v for k, v in info.items()},
                        "samples": samples,
                        "analysis": analysis,
                        "publisher_analysis": publisherAnalysis,
                    },
                    f,
                )
            for line in text:
                log(line)
            lines += text
    except BenchError as error:
        print(f"flow_control.py: {error}", file=sys.stderr)
        return 1
    if udpPlots:
        png = os.path.join(plots, "flow-control-udp.png")
        plotUdp(udpPlots, png)
        for summary in summaries:
            summary["plot"] = png
    reproduce = shlex.join([sys.executable, "bench/flow_control.py", *(argv or sys.argv[1:])])
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(
            {"options": vars(options), "summaries": summaries, "reproduce": reproduce}, f, indent=1
        )
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(
            f"# flow control, {options.transport}\n\n```\n"
            + "\n".join(lines)
            + f"\n```\n\nreproduce: `{reproduce}`\n"
        )
    log(
        f"wrote {out}/summary.json, summary.md, the captures (*.pcapng) and samples; "
        f"plots in {plots}"
    )
    log("reproduce: " + reproduce)
    return 0


if __name__ == "__main__":
    sys.exit(main())
