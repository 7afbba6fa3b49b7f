"""
User and broker names (L{dallal.names}).
"""

import pytest

from dallal.names import checkBrokerName, checkUserName


@pytest.mark.parametrize("name", ["alice", "a", "bob.smith@example.com", "dev-7_x", "9" * 64])
def test_goodUserNames(name):
    checkUserName(name)


@pytest.mark.parametrize(
    "name", ["", "-x", ".x", "a b", "a:b", "a/b", "a+b", "a#b", "a=b", "é", "x" * 65, "a\n"]
)
def test_badUserNames(name):
    with pytest.raises(ValueError, match="^user name .* must be 1 to 64 "):
        checkUserName(name)


@pytest.mark.parametrize("name", ["hub", "leaf-1", "eu.west_2", "9" * 64])
def test_goodBrokerNames(name):
    checkBrokerName(name)


@pytest.mark.parametrize("name", ["", "-x", "a b", "a@b", "a/b", "é", "x" * 65, "a\n"])
def test_badBrokerNames(name):
    with pytest.raises(ValueError) as raised:
        checkBrokerName(name, "--name")
    assert str(raised.value) == (
        f"--name {name!r} must be 1 to 64 letters, digits, '.', '_' or '-', "
        "starting with a letter or a digit"
    )
