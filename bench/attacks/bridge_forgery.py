"""
bridge-forgery: bridge frames only from bridges.

A hub (no logins) and a leaf bridged to it (--bridge hub=..., with
--passwords and an --acl that lets mallory write only users/mallory/#).
Mallory, an ordinary user of the leaf, subscribes with bridge=1 to learn
the hub's message ids (origin=hub oid=<incarnation>.<n>), then publishes on
her own topic PUBs carrying origin=hub oid=<the hub's next ids> hops=0. A
publisher on the hub then publishes on news, which a reader on the leaf
subscribes to: a leaf that believed mallory discards those real messages as
copies of what it already routed.

PASS if the leaf refuses mallory's bridge frames (PUB with origin=, SUB with
bridge=1) and the reader gets every real message. (The hub takes no
passwords, so anyone may bridge to it: she may learn its ids there.)
"""

import re
import time

import attacklib as lib

NAME = "bridge-forgery"
REAL_MESSAGES = 20
FORGED = 200


def attack():
    with lib.scratch() as hubDirectory, lib.scratch() as leafDirectory:
        with lib.dallal(hubDirectory, ["--name", "hub"]) as hub:
            passwords = lib.writePasswords(
                leafDirectory, {"mallory": "mallory-pw", "reader": "reader-pw"}
            )
            acl = lib.writeFile(
                leafDirectory,
                "acl",
                "user mallory\ntopic readwrite users/mallory/#\n\nuser reader\ntopic read #\n",
            )
            leafOptions = [
                "--name",
                "leaf",
                "--passwords",
                passwords,
                "--acl",
                acl,
                "--bridge",
                f"hub=tcp:127.0.0.1:{hub.port}",
            ]
            with lib.dallal(leafDirectory, leafOptions) as leaf:
                deadline = time.monotonic() + 15
                while b"event=bridge_up" not in lib.logText(leaf):
                    if time.monotonic() > deadline:
                        raise lib.BenchError("the leaf's bridge did not come up")
                    time.sleep(0.1)
                return run(hub, leaf)


def learnHubOid(mallory, hubMallory):
    """
    The hub's incarnation and the last message id it used, as mallory can
    learn them: a bridge=1 subscription (on the leaf, else on the hub, which
    takes no passwords and so lets anyone bridge) shows the origin of a
    message she publishes on the hub.

    @return: (whether the leaf took her bridge=1 SUB, (incarnation, number,
        where she learned them) or None).
    """
    leafTookIt = False
    for connection, where in ((mallory, "leaf"), (hubMallory, "hub")):
        answer = connection.request(b"SUB b users/mallory/# mode=fire bridge=1", b"b")
        if answer is None or not answer[0].startswith(b"SUBACK"):
            continue
        leafTookIt = leafTookIt or where == "leaf"
        hubMallory.request(b"PUB probe users/mallory/probe 5", b"probe", b"probe")
        message = connection.waitFor(lambda line: line.startswith(b"MSG users/mallory/probe"), 5)
        if message is None:
            continue
        found = re.search(rb"origin=hub oid=([0-9a-f]+)\.(\d+)", message[0])
        if found:
            return leafTookIt, (found.group(1), int(found.group(2)), where)
    return leafTookIt, None


def run(hub, leaf):
    reader = lib.Connection(leaf.port)
    reader.login("reader", "reader-pw", "reader")
    if not reader.request(b"SUB r news mode=fire", b"r")[0].startswith(b"SUBACK"):
        raise lib.BenchError("the reader could not subscribe")
    mallory = lib.Connection(leaf.port)
    mallory.login("mallory", "mallory-pw", "mallory")
    hubMallory = lib.Connection(hub.port)
    leafTookBridgeSub, learned = learnHubOid(mallory, hubMallory)
    if learned is None:
        # She could not learn them: forge ids all the same, which a leaf
        # must refuse whatever they are.
        incarnation, last, where = b"00000000", 0, "nowhere"
    else:
        incarnation, last, where = learned
    frames = b"".join(
        b"PUB f%d users/mallory/junk 1 origin=hub oid=%s.%d hops=0\r\nx\r\n"
        % (k, incarnation, last + k)
        for k in range(1, FORGED + 1)
    )
    mallory.send(frames)
    accepted = refused = 0
    for k in range(1, FORGED + 1):
        try:
            answer = mallory.answer(b"f%d" % k, timeout=10)
        except lib.Closed:
            # The leaf closed her connection after refusing a run of them
            # (--max-consecutive-errors): the rest are refused unread.
            refused = FORGED - accepted
            break
        if answer is None:
            break
        if answer[0].startswith(b"PUBACK"):
            accepted += 1
        else:
            refused += 1
    # The real messages, published on the hub after the forgery.
    publisher = lib.Connection(hub.port)
    for number in range(REAL_MESSAGES):
        publisher.request(b"PUB n%d news 6" % number, b"n%d" % number, b"real%02d" % number)
    got = set()
    deadline = time.monotonic() + 5
    while len(got) < REAL_MESSAGES and time.monotonic() < deadline:
        frame = reader.waitFor(
            lambda line: line.startswith(b"MSG news"), deadline - time.monotonic()
        )
        if frame is None:
            break
        got.add(frame[1])
    for connection in (reader, mallory, hubMallory, publisher):
        connection.close()
    passed = accepted == 0 and not leafTookBridgeSub and len(got) == REAL_MESSAGES
    figure = (
        f"the leaf {'accepted' if leafTookBridgeSub else 'refused'} mallory's SUB bridge=1 "
        f"(ACL: users/mallory/# only); she learned the hub's oids on {where}; "
        f"the leaf accepted {accepted}/{FORGED} PUBs with forged origin=hub oid= on her own topic "
        f"({refused} refused); the reader got {len(got)}/{REAL_MESSAGES} real news messages "
        f"from the hub"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack())
