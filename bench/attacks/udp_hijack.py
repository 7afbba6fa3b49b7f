"""
udp-hijack: a client id is not a credential.

On a broker with --passwords, --acl and --udp, the victim (user alice,
who may read secret/#) logs in over UDP and subscribes to secret/#. The
attacker, from another address (127.0.0.2), knows only the victim's client
id. It says HELLO with that id and no password, which any address may do
and which answers a token bound to the id and the attacker's address; it
echoes the token in a HELLO without credentials, then in one with
mallory's own (a user of the broker); then it sends with
client=<victim's id> token=<that token>: SUB, PUB, PING, STATS,
ACK of deliveries it saw, the victim's own datagrams replayed from its
socket, BYE with a guessed token, and last BYE with its token.

PASS if the attacker is answered nothing but its token and refusals (no
HELLO resuming the session, no SUBACK, PUBACK, PONG, STATS, BYE, no MSG),
and the victim keeps its session, its subscription and every message
published for it.
"""

import re
import secrets
import time

import attacklib as lib

NAME = "udp-hijack"
MESSAGES = 3


def attack():
    with lib.scratch() as directory:
        with lib.dallal(directory, lib.aliceAndMallory(directory), udp=True) as broker:
            return run(broker)


def run(broker):
    victim = lib.UdpClient(broker.udpPort, source="127.0.0.1")
    victimId = "victim-" + secrets.token_hex(8)
    answer = victim.hello(victimId, lib.credentialOptions("alice", "alice-pw"), timeout=10)
    if answer is None or b"session=new" not in answer:
        raise lib.BenchError(f"the victim could not log in: {answer!r}")
    subscribe = victim.frame(b"SUB 1 secret/# mode=all")
    victim.sendRaw(subscribe)
    if victim.waitFor(lambda d: d.startswith(b"SUBACK 1"), 3) is None:
        raise lib.BenchError("the victim could not subscribe")

    attacker = lib.UdpClient(broker.udpPort, source=lib.OTHER_HOST)
    token = attacker.askToken(victimId)
    if token is None:
        raise lib.BenchError("the broker gave the attacker no token at all")
    won = []  # what the attacker obtained

    def tryAs(line, requestId, payload=None, what=None, **identity):
        attacker.sendRaw(attacker.frame(line, payload, **identity))
        if requestId is None:
            # No id: the answer is PONG or BYE (or an ERR), not a MSG.
            got = attacker.waitFor(lambda d: not d.startswith(b"MSG "), 1.0)
        else:
            got = attacker.waitFor(lambda d: d.split()[1:2] == [requestId], 1.0)
        if got is not None and not got.startswith((b"ERR", b"HELLO")):
            verb = got.split(b" ")[0].strip().decode()
            won.append(f"{what or line.split(b' ')[0].decode()}->{verb}")
        return got

    own = dict(clientId=victimId, token=token)
    # HELLOs that would resume the victim's session here: without
    # credentials, and with mallory's own.
    for number, credentials in enumerate(("", lib.credentialOptions("mallory", "mallory-pw"))):
        attacker.sendRaw(
            b"HELLO r%d %s token=%s %s\r\n"
            % (number, victimId.encode(), token.encode(), credentials.encode())
        )
        resumed = attacker.waitFor(lambda d, number=number: d.split()[1:2] == [b"r%d" % number], 3)
        if resumed is not None and resumed.startswith(b"HELLO"):
            won.append(f"HELLO {'with mallory' if credentials else 'without'} credentials->HELLO")
    tryAs(b"SUB a1 secret/# mode=fire", b"a1", **own)
    tryAs(b"PUB a2 secret/forged 6", b"a2", b"forged", **own)
    tryAs(b"PING", None, what="PING", **own)
    tryAs(b"STATS a3", b"a3", **own)

    # A message for alice, published over TCP by alice herself.
    publisher = lib.Connection(broker.port)
    publisher.login("alice", "alice-pw", "alice-tcp")
    for number in range(MESSAGES):
        publisher.request(b"PUB q%d secret/news 5" % number, b"q%d" % number, b"news%d" % number)
    time.sleep(0.5)
    # Ack what the attacker received, as the victim would.
    for data in list(attacker.received):
        match = re.match(rb"MSG \S+ \d+ .*id=(\S+)", data)
        if match:
            tryAs(b"ACK " + match.group(1), None, what="ACK", **own)
    # Replay the victim's own SUB datagram from the attacker's socket.
    attacker.sendRaw(subscribe)
    replay = attacker.waitFor(lambda d: d.split()[1:2] == [b"1"], 1.0)
    if replay is not None and not replay.startswith(b"ERR"):
        won.append("replayed victim's SUB->" + replay.split(b" ")[0].decode())
    # BYE with a guessed token.
    tryAs(b"BYE", None, what="BYE with a guessed token", clientId=victimId, token="A" * 16)

    attackerMessages = sum(1 for data in attacker.received if data.startswith(b"MSG "))
    # The victim: does it still get its messages, and keep its session?
    victim.sendRaw(victim.frame(b"PING"))
    victim.waitFor(lambda d: d.startswith((b"PONG", b"ERR")), 2)
    publisher.request(b"PUB late secret/news 4", b"late", b"late")
    # A MSG lost to the attacker is resent after --udp-ack-timeout (1 s);
    # the victim acks what it gets, as a client does.
    for data in victim.receive(1.5):
        delivery = re.match(rb"MSG \S+ \d+ .*id=(\S+)", data)
        if delivery:
            victim.sendRaw(victim.frame(b"ACK " + delivery.group(1)))
    victimMessages = {
        data.split(b"\r\n")[1] for data in victim.received if data.startswith(b"MSG ")
    }
    # Last: BYE with the attacker's own token for the victim's id.
    tryAs(b"BYE", None, **own)
    victim.sendRaw(victim.frame(b"PING"))
    after = victim.waitFor(lambda d: d.startswith((b"PONG", b"ERR")), 2)
    sessionKept = after is not None and after.startswith(b"PONG")
    publisher.close()
    expected = {b"news%d" % number for number in range(MESSAGES)} | {b"late"}
    victimGot = len(expected & victimMessages)
    attackerWon = bool(won) or attackerMessages > 0
    passed = not attackerWon and victimGot == len(expected) and sessionKept
    figure = (
        f"attacker (another address, the victim's client id, not its password) obtained "
        f"{', '.join(won) or 'nothing'} and {attackerMessages} of the victim's messages; "
        f"victim got {victimGot}/{len(expected)} of its messages, session "
        f"{'kept' if sessionKept else 'lost: ' + repr(after)}"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack())
