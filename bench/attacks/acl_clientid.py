"""
acl-clientid: a client id is not a credential in the ACL either (beyond
the issue's list).

A broker with --passwords and an --acl whose only grant is README's
example pattern `pattern readwrite devices/%c/#` (each client its own
device topics, by client id). Alice's device logs in as alice with client
id alice-phone and subscribes to devices/alice-phone/#. Mallory logs in
with her own password and the client id alice-phone, subscribes to
devices/alice-phone/# and publishes a command there.

PASS if mallory is refused (the client id a user may take is bound to the
user, or %c grants nothing to a client id another user holds), and alice's
device gets only what alice's side published. Mosquitto's %c patterns have
the same weakness unless client ids are tied to user names
(use_username_as_clientid): the figure says what Dallal does.
"""

import time

import attacklib as lib

NAME = "acl-clientid"


def attack():
    with lib.scratch() as directory:
        passwords = lib.writePasswords(directory, {"alice": "alice-pw", "mallory": "mallory-pw"})
        acl = lib.writeFile(directory, "acl", "pattern readwrite devices/%c/#\n")
        with lib.dallal(directory, ["--passwords", passwords, "--acl", acl]) as broker:
            device = lib.Connection(broker.port)
            device.login("alice", "alice-pw", "alice-phone")
            device.request(b"SUB d devices/alice-phone/# mode=fire", b"d")
            mallory = lib.Connection(broker.port)
            mallory.login("mallory", "mallory-pw", "alice-phone")
            subscribed = mallory.request(b"SUB m devices/alice-phone/# mode=fire", b"m")
            published = mallory.request(b"PUB p devices/alice-phone/cmd 6", b"p", b"unlock")
            owner = lib.Connection(broker.port)
            owner.login("alice", "alice-pw", "alice-phone")
            owner.request(b"PUB o devices/alice-phone/status 7", b"o", b"private")
            time.sleep(0.5)
            readByMallory = mallory.waitFor(
                lambda line: line.startswith(b"MSG devices/alice-phone/status"), 1
            )
            forged = device.waitFor(lambda line: line.startswith(b"MSG devices/alice-phone/cmd"), 1)
            for connection in (device, mallory, owner):
                connection.close()
    subscribedOk = subscribed is not None and subscribed[0].startswith(b"SUBACK")
    publishedOk = published is not None and published[0].startswith(b"PUBACK")
    passed = not subscribedOk and not publishedOk and readByMallory is None and forged is None
    figure = (
        f"mallory, logged in as herself with client id alice-phone: SUB devices/alice-phone/# "
        f"{'accepted' if subscribedOk else 'refused'}, PUB of a command there "
        f"{'accepted' if publishedOk else 'refused'}; she "
        f"{'read' if readByMallory else 'did not read'} alice's status, and alice's device "
        f"{'received' if forged else 'did not receive'} her forged command"
    )
    return passed, figure


if __name__ == "__main__":
    lib.runAttack(NAME, __doc__, lambda options: attack())
