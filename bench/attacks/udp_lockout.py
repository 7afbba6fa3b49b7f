"""
udp-lockout: one address cannot lock others out over UDP (beyond the
issue's list).

Two attacks from 127.0.0.1 alone, each followed by real users from other
addresses:

 A. session exhaustion: on a broker with --udp --max-udp-clients 300 (the
    default, 10,000, takes 200 s to fill at one address's HELLO rate), and
    --max-udp-clients-per-ip 30 where the broker has it (a tenth, as the
    defaults are and as TCP's --max-connections-per-ip is), the attacker
    starts sessions until refused. Then a real client from 127.0.0.2
    starts one. (The attack is over before its sessions would expire
    unpinged.)
 B. login flood over UDP: on --passwords --udp, the attacker gets tokens
    for 100 client ids at its own address, then for 20 s sends HELLOs with
    those tokens and wrong passwords, as fast as the HELLO rate lets one
    address (100 a second). Halfway, a real user logs in over UDP from
    127.0.0.2 (resending as the client library does) and another over TCP
    from 127.0.0.3: the checks of both transports share one queue.

PASS if the real client of A gets its session, and both real logins of B
complete within 3 s.
"""

import threading
import time

import attacklib as lib

NAME = "udp-lockout"
MAX_UDP_CLIENTS = 300
PER_IP_OPTIONS = {"--max-udp-clients-per-ip": MAX_UDP_CLIENTS // 10}
FLOOD_SECONDS = 20.0
LOGIN_LIMIT = 3.0


def exhaustion():
    perIp, _ = lib.optionsIfPresent(PER_IP_OPTIONS)
    with (
        lib.scratch() as directory,
        lib.dallal(
            directory, ["--max-udp-clients", str(MAX_UDP_CLIENTS), *perIp], udp=True
        ) as broker,
    ):
        attacker = lib.UdpClient(broker.udpPort, source="127.0.0.1")
        taken = 0
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            answer = attacker.hello(f"hog-{taken}", timeout=2)
            if answer is None:
                continue  # over the HELLO rate: the resend gets through later
            if b"TOO_MANY_CLIENTS" in answer:
                break
            taken += 1
        victim = lib.UdpClient(broker.udpPort, source=lib.OTHER_HOST)
        answer = None
        for _ in range(3):
            answer = victim.hello("real-client", timeout=2)
            if answer is not None:
                break
        attacker.close()
        victim.close()
    started = answer is not None and b"session=new" in answer
    return started, (
        f"A: 127.0.0.1 took {taken}/{MAX_UDP_CLIENTS} UDP sessions; a real client from "
        f"127.0.0.2 {'got its session' if started else 'was refused: ' + repr((answer or b'no answer')[:60])}"
    )


def udpLogin(port, outcome):
    client = lib.UdpClient(port, source=lib.OTHER_HOST)
    start = time.monotonic()
    token = None
    while token is None and time.monotonic() - start < 15:
        token = client.askToken("real-udp", timeout=0.5)
    answer = None
    delay = 0.25
    while token is not None and answer is None and time.monotonic() - start < 15:
        client.sendRaw(
            b"HELLO s real-udp token=%s %s\r\n"
            % (token.encode(), lib.credentialOptions("alice", "alice-pw").encode())
        )
        answer = client.waitFor(lambda data: data.split()[1:2] == [b"s"], delay)
        delay = min(delay * 2, 1.0)
    client.close()
    outcome["udp"] = (
        time.monotonic() - start if answer is not None and answer.startswith(b"HELLO") else None
    )


def tcpLogin(port, outcome):
    start = time.monotonic()
    try:
        connection = lib.Connection(port, source="127.0.0.3", timeout=20)
        connection.login("alice", "alice-pw", "real-tcp", timeout=15)
        outcome["tcp"] = time.monotonic() - start
        connection.close()
    except (lib.BenchError, lib.Closed, OSError):
        outcome["tcp"] = None


def loginFlood():
    with lib.scratch() as directory:
        passwords = lib.writePasswords(directory, {"alice": "alice-pw"})
        with lib.dallal(directory, ["--passwords", passwords], udp=True) as broker:
            attacker = lib.UdpClient(broker.udpPort, source="127.0.0.1")
            tokens = {}
            for number in range(100):
                clientId = f"guess-{number}"
                token = attacker.askToken(clientId, timeout=2)
                if token is not None:
                    tokens[clientId] = token
            time.sleep(1)  # a full bucket of HELLOs again
            wrong = lib.credentialOptions("alice", "wrong").encode()
            frames = [
                b"HELLO g %s token=%s %s\r\n" % (clientId.encode(), token.encode(), wrong)
                for clientId, token in tokens.items()
            ]
            sent = [0]

            def flood():
                start = time.monotonic()
                while time.monotonic() - start < FLOOD_SECONDS:
                    attacker.sendRaw(frames[sent[0] % len(frames)])
                    sent[0] += 1
                    time.sleep(max(0.0, start + sent[0] / 100 - time.monotonic()))

            flooding = threading.Thread(target=flood)
            flooding.start()
            time.sleep(FLOOD_SECONDS / 2)
            outcome = {}
            threads = [
                threading.Thread(target=udpLogin, args=(broker.udpPort, outcome)),
                threading.Thread(target=tcpLogin, args=(broker.port, outcome)),
            ]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            flooding.join()
            attacker.close()
    udp, tcp = outcome.get("udp"), outcome.get("tcp")
    passed = udp is not None and tcp is not None and udp < LOGIN_LIMIT and tcp < LOGIN_LIMIT

    def shown(seconds):
        return "never (15 s)" if seconds is None else f"{seconds:.1f} s"

    return passed, (
        f"B: during {sent[0]} wrong-password UDP HELLOs from 127.0.0.1 in {FLOOD_SECONDS:g} s, "
        f"a real UDP login took {shown(udp)}, a real TCP login {shown(tcp)}"
    )


def attack():
    passedA, figureA = exhaustion()
    passedB, figureB = loginFlood()
    return passedA and passedB, f"{figureA}; {figureB} (limit: logins < {LOGIN_LIMIT:g} s)"


if __name__ == "__main__":
    lib.runAttack(
        NAME,
        __doc__,
        lambda options: attack(),
        note=f"--max-udp-clients {MAX_UDP_CLIENTS} in A; "
        + lib.optionsIfPresent(PER_IP_OPTIONS)[1],
    )
