"""
The password file (L{dallal.security.passwords}) and the C{dallal-passwd} command
that writes it: the hash format, errors with the file and line, and the
command run for real, with C{DALLAL_PASSWORD} and on a pseudo-terminal.
"""

import os
import re
import stat
import subprocess
import sys

import pytest
from helpers import CHEAP_SCRYPT, COMMAND_TIMEOUT, Conversation, environmentWithout

from dallal.security.passwords import (
    DEFAULT_N,
    PasswordFile,
    PasswordFileError,
    PasswordHash,
)

PASSWD = [sys.executable, "-m", "dallal.cli.passwd"]


# The hash


def test_hashFormat():
    """
    C{$scrypt$n=...,r=...,p=...$salt$digest}: the parameters travel with the
    hash, the salt is random, and the digest is scrypt's.
    """
    hashed = PasswordHash.make(b"pw")
    text = str(hashed)
    match = re.fullmatch(
        r"\$scrypt\$n=16384,r=8,p=1\$([A-Za-z0-9+/]{22})\$([A-Za-z0-9+/]{43})", text
    )
    assert match, text
    assert PasswordHash.parse(text) == hashed
    assert hashed.verify(b"pw") and not hashed.verify(b"pW")
    assert str(PasswordHash.make(b"pw")) != text
    # The digest never shows in a repr.
    assert repr(hashed) == f"PasswordHash(n={DEFAULT_N}, r=8, p=1)"


def test_otherParametersStillVerify():
    """
    A hash made with other parameters is checked with its own: they can be
    raised later without invalidating the file.
    """
    cheap = PasswordHash.make(b"pw", **CHEAP_SCRYPT)
    assert str(cheap).startswith("$scrypt$n=2,r=1,p=1$")
    assert PasswordHash.parse(str(cheap)).verify(b"pw")


@pytest.mark.parametrize(
    "text, reason",
    [
        ("plain", "the hash is not $scrypt$"),
        ("$scrypt$n=16384,r=8$c2FsdA$ZGln", "the hash is not $scrypt$"),
        ("$scrypt$n=1000,r=8,p=1$c2FsdA$" + "A" * 43, "scrypt n=1000 is not a power of 2"),
        ("$scrypt$n=33554432,r=8,p=1$c2FsdA$" + "A" * 43, "is not a power of 2 from 2 to"),
        ("$scrypt$n=16384,r=99,p=1$c2FsdA$" + "A" * 43, "out of bounds"),
        ("$scrypt$n=16384,r=8,p=1$c2FsdA$QQ", "the digest is too short"),
        ("$scrypt$n=16384,r=8,p=1$c$" + "A" * 43, "the salt or digest is not base64"),
        ("$7$101$c2FsdA==$ZGln", "a Mosquitto hash"),
    ],
)
def test_badHashes(text, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        PasswordHash.parse(text)


# The file


def writeFile(folder, text):
    path = folder / "passwords"
    path.write_text(text)
    return path


def test_fileKeepsCommentsAndOrder(tmp_path):
    alice = PasswordHash.make(b"a", **CHEAP_SCRYPT)
    path = writeFile(tmp_path, f"# operators\nalice:{alice}\n\n# devices\n")
    passwords = PasswordFile.load(path)
    assert list(passwords.users) == ["alice"]
    bob = PasswordHash.make(b"b", **CHEAP_SCRYPT)
    assert passwords.set("bob", bob) is True
    assert passwords.set("alice", bob) is False
    passwords.save()
    assert path.read_text() == f"# operators\nalice:{bob}\n\n# devices\nbob:{bob}\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    passwords.delete("alice")
    passwords.save()
    assert path.read_text() == f"# operators\n\n# devices\nbob:{bob}\n"
    assert [name for name in os.listdir(tmp_path)] == ["passwords"]


@pytest.mark.parametrize(
    "text, error",
    [
        ("alice\n", ":1: expected <user>:<hash>"),
        ("# c\nal ice:x\n", ":2: user name 'al ice' must be"),
        ("alice:nope\n", ":1: the hash is not $scrypt$"),
        ("alice:{h}\nbob:{h}\nalice:{h}\n", ":3: user alice is listed twice"),
    ],
)
def test_fileErrorsNameTheLine(tmp_path, text, error):
    path = writeFile(tmp_path, text.format(h=PasswordHash.make(b"x", **CHEAP_SCRYPT)))
    with pytest.raises(PasswordFileError) as raised:
        PasswordFile.load(path)
    assert str(raised.value).startswith(f"{path}{error}"), str(raised.value)


def test_missingFile(tmp_path):
    with pytest.raises(PasswordFileError, match="cannot read the password file .*: no such file"):
        PasswordFile.load(tmp_path / "missing")
    assert PasswordFile.load(tmp_path / "missing", missingIsEmpty=True).users == {}


# dallal-passwd, for real


def passwd(*arguments, password=None, cwd=None):
    env = environmentWithout("DALLAL_PASSWORD")
    if password is not None:
        env["DALLAL_PASSWORD"] = password
    return subprocess.run(
        [*PASSWD, *map(str, arguments)],
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=COMMAND_TIMEOUT,
    )


@pytest.mark.e2e
def test_passwdAddsChangesAndDeletes(tmp_path):
    path = tmp_path / "passwords"
    result = passwd(path, "alice", password="first one")
    assert (result.returncode, result.stdout, result.stderr) == (
        0,
        f"added alice to {path}\n".encode(),
        b"",
    )
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = PasswordFile.load(path).users["alice"]
    assert first.verify(b"first one") and str(first).startswith("$scrypt$n=16384,r=8,p=1$")

    result = passwd(path, "bob", password="b")
    result = passwd(path, "alice", password="second one")
    assert result.stdout == f"changed the password of alice in {path}\n".encode()
    users = PasswordFile.load(path).users
    assert list(users) == ["alice", "bob"]
    assert users["alice"].verify(b"second one") and not users["alice"].verify(b"first one")

    result = passwd("-D", path, "alice")
    assert result.stdout == f"deleted alice from {path}\n".encode()
    assert list(PasswordFile.load(path).users) == ["bob"]


@pytest.mark.e2e
@pytest.mark.parametrize(
    "arguments, password, error",
    [
        (["-D", "{path}", "carol"], None, "{path} has no user carol; nothing changed"),
        (["{path}", "bad name"], "x", "user name 'bad name' must be"),
        (["{path}", "carol"], "", "an empty password is refused; nothing changed"),
        (["{path}", "carol"], None, "no terminal to type the password on: set DALLAL_PASSWORD"),
        (["{folder}/nowhere/passwords", "carol"], "x", "cannot write {folder}/nowhere/passwords"),
    ],
)
def test_passwdErrors(tmp_path, arguments, password, error):
    path = tmp_path / "passwords"
    passwd(path, "bob", password="b")
    before = path.read_bytes()
    arguments = [argument.format(path=path, folder=tmp_path) for argument in arguments]
    result = passwd(*arguments, password=password)
    assert result.returncode == 1 and result.stdout == b""
    expected = "dallal-passwd: " + error.format(path=path, folder=tmp_path)
    assert result.stderr.decode().startswith(expected), result.stderr
    assert path.read_bytes() == before


@pytest.mark.e2e
def test_passwdRefusesABrokenFile(tmp_path):
    path = writeFile(tmp_path, "junk\n")
    result = passwd(path, "alice", password="x")
    assert result.stderr == f"dallal-passwd: {path}:1: expected <user>:<hash>\n".encode()
    assert path.read_text() == "junk\n"


def onTerminal(arguments):
    """
    C{dallal-passwd} with a pseudo-terminal for its standard input, output
    and error, and no C{DALLAL_PASSWORD}.
    """
    master, terminal = os.openpty()
    process = subprocess.Popen(
        [*PASSWD, *map(str, arguments)],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        env=environmentWithout("DALLAL_PASSWORD"),
        start_new_session=True,
    )
    os.close(terminal)
    return Conversation(process, master, master)


@pytest.mark.e2e
@pytest.mark.parametrize("again, added", [(b"typed secret", True), (b"typo", False)])
def test_passwdAsksTwiceWithoutEcho(tmp_path, again, added):
    path = tmp_path / "passwords"
    conversation = onTerminal([path, "alice"])
    try:
        conversation.expect(re.escape(b"password: "))
        conversation.type(b"typed secret\r")
        conversation.expect(re.escape(b"password again: "))
        conversation.type(again + b"\r")
        if added:
            conversation.expect(re.escape(f"added alice to {path}".encode()))
        else:
            conversation.expect(b"dallal-passwd: the two passwords differ; nothing changed")
        assert conversation.wait() == (0 if added else 1)
    finally:
        conversation.process.kill()
        os.close(conversation.readFrom)
    # The terminal did not echo what was typed.
    assert b"typed secret" not in conversation.output and b"typo" not in conversation.output
    if added:
        assert PasswordFile.load(path).users["alice"].verify(b"typed secret")
    else:
        assert not path.exists()
