"""
login-flood: password checks cannot be used to lock users out.

A broker with --passwords (and --ping-interval 1, so that a client dropped
for missed pings is dropped within seconds rather than 40 s). From
127.0.0.1 the attacker opens 200 connections, then (on a fresh broker) 700,
and sends on each, in one burst, a HELLO with a wrong password. Right after
the burst three real users, from 127.0.0.3 to 127.0.0.5 (other hosts),
log in with the right password while answering the broker's PINGs.

PASS if in both rounds every real login completes in under 3 s, none is
dropped, and the broker's resident memory peaks less than 32 MiB above
its peak once four wrong logins sent together are answered (scrypt takes
16 MiB a check, and the broker runs two checks at a time).

With --broker dallal-mqtt, the same over Dallal's --mqtt listener: each
attacking connection sends a CONNECT with a wrong password, and the real
users a CONNECT with theirs (a login is its CONNACK).
"""

import socket
import threading
import time

import attacklib as lib
from protocols import mqttPacket, mqttString

NAME = "login-flood"
ROUNDS = (200, 700)
REAL_USERS = ("127.0.0.3", "127.0.0.4", "127.0.0.5")
LOGIN_LIMIT = 3.0
GROWTH_LIMIT = 32 * lib.MiB
REAL_TIMEOUT = 40.0


def wrongHello(number):
    return b"HELLO w%d flood%d %s\r\n" % (
        number,
        number,
        lib.credentialOptions("alice", f"wrong-{number}").encode(),
    )


def wrongConnect(number):
    """
    An MQTT 3.1.1 CONNECT (Clean Session, user name and password) as alice
    with a wrong password.
    """
    return mqttPacket(
        1,
        0,
        mqttString(b"MQTT")
        + bytes([4, 0xC2, 0, 60])
        + mqttString(b"flood%d" % number)
        + mqttString(b"alice")
        + mqttString(b"wrong-%d" % number),
    )


def realLogin(kind, port, source, outcome):
    """
    Log in as alice from C{source}, answering PINGs meanwhile; put in
    C{outcome} the seconds it took, or why it failed.
    """
    start = time.monotonic()
    if kind == "dallal-mqtt":
        outcome[source] = realConnect(port, source, start)
        return
    try:
        connection = lib.Connection(port, source=source, timeout=REAL_TIMEOUT)
        connection.send(
            b"HELLO h real %s\r\n" % lib.credentialOptions("alice", "alice-pw").encode()
        )
        answer = connection.waitFor(
            lambda line: line.split()[1:2] == [b"h"] or line.startswith(b"ERR"), REAL_TIMEOUT
        )
    except lib.Closed:
        outcome[source] = f"dropped after {time.monotonic() - start:.1f} s"
        return
    except OSError as error:
        outcome[source] = f"failed: {error}"
        return
    if answer is None:
        outcome[source] = f"no answer in {REAL_TIMEOUT:g} s"
    elif answer[0].startswith(b"HELLO"):
        outcome[source] = time.monotonic() - start
    else:
        outcome[source] = f"refused after {time.monotonic() - start:.1f} s: {answer[0][:60]!r}"
    connection.close()


def realConnect(port, source, start):
    """
    alice's CONNECT from C{source}: the seconds to its CONNACK, or why it
    failed.
    """
    client = lib.MqttClient(port, source=source, timeout=REAL_TIMEOUT)
    try:
        code = client.connect(
            "real-" + source, timeout=REAL_TIMEOUT, user="alice", password="alice-pw"
        )
    finally:
        client.close()
    took = time.monotonic() - start
    if code is None:
        return f"no CONNACK in {took:.1f} s"
    if code != 0:
        return f"refused after {took:.1f} s: return code {code}"
    return took


class MemoryWatch(threading.Thread):
    """
    The broker's largest resident memory while it runs.
    """

    def __init__(self, broker):
        threading.Thread.__init__(self, daemon=True)
        self.broker = broker
        self.peak = 0
        self.running = True

    def run(self):
        while self.running and self.broker.alive():
            try:
                self.peak = max(self.peak, self.broker.residentMemory())
            except (OSError, lib.BenchError):
                break
            time.sleep(0.05)


def warmUp(kind, port):
    """
    Four wrong logins sent together, answered.
    """
    if kind == "dallal-mqtt":
        warm = [lib.MqttClient(port) for _ in range(4)]
        for number, client in enumerate(warm):
            client.send(wrongConnect(number))
        for client in warm:
            client.waitFor(lambda kind, flags, body: kind == 2, 20)
            client.close()
        return
    warm = [lib.Connection(port) for _ in range(4)]
    for number, connection in enumerate(warm):
        connection.send(wrongHello(number))
    for connection in warm:
        connection.waitFor(lambda line: line.startswith(b"ERR"), 20)
        connection.close()


def floodRound(kind, size):
    with lib.scratch() as directory:
        passwords = lib.writePasswords(directory, {"alice": "alice-pw"})
        options = ["--passwords", passwords, "--ping-interval", "1"]
        with lib.brokerAndPort(kind, directory, options) as (broker, port):
            # Four wrong logins first: the memory their checks take is not the flood's.
            warmUp(kind, port)
            # The flood's cost is what it adds to their peak.
            baseline = broker.peakMemory()
            watch = MemoryWatch(broker)
            watch.start()
            flood = []
            for _ in range(size):
                sock = socket.create_connection(("127.0.0.1", port), timeout=10)
                flood.append(sock)
            wrong = wrongConnect if kind == "dallal-mqtt" else wrongHello
            burst = time.monotonic()
            for number, sock in enumerate(flood):
                sock.send(wrong(number))
            burst = time.monotonic() - burst
            outcome = {}
            threads = [
                threading.Thread(target=realLogin, args=(kind, port, source, outcome))
                for source in REAL_USERS
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(REAL_TIMEOUT + 5)
            watch.running = False
            watch.join()
            for sock in flood:
                sock.close()
            return outcome, watch.peak - baseline, burst


def attack(kind):
    passed = True
    parts = []
    for size in ROUNDS:
        outcome, growth, burst = floodRound(kind, size)
        times = [value for value in outcome.values() if isinstance(value, float)]
        failures = [value for value in outcome.values() if not isinstance(value, float)]
        slowest = max(times) if times else float("nan")
        ok = (
            not failures
            and len(times) == len(REAL_USERS)
            and slowest < LOGIN_LIMIT
            and growth < GROWTH_LIMIT
        )
        passed = passed and ok
        described = f"real logins {', '.join(f'{t:.1f} s' for t in sorted(times)) or 'none'}"
        if failures:
            described += f", {'; '.join(failures)}"
        parts.append(
            f"{kind}: {size} wrong {'CONNECT' if kind == 'dallal-mqtt' else 'HELLO'}s in {burst * 1000:.0f} ms: {described}, RSS +{lib.mib(growth)}"
        )
    figure = (
        " | ".join(parts)
        + f" (limits: each real login < {LOGIN_LIMIT:g} s, none dropped, RSS growth < {lib.mib(GROWTH_LIMIT)})"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(
        NAME,
        __doc__,
        lambda options: attack(options.broker),
        peers=("dallal-mqtt",),
        note="--ping-interval 1",
    )
