"""
Numbers in text from outside (L{dallal.numbers}).
"""

import argparse

import pytest
from twisted.python import usage

from dallal.numbers import positiveNumber, wholeNumber


@pytest.mark.parametrize(
    "text, number",
    [
        ("12", 12),
        (b"007", 7),
        ("", None),
        ("1" * 11, None),
        ("+1", None),
        ("²", None),
        ("1_0", None),
    ],
)
def test_wholeNumber(text, number):
    assert wholeNumber(text, 10) == number


@pytest.mark.parametrize(
    "text, bounds, value",
    [
        ("5", {}, 5),
        ("0", {"zero": True}, 0),
        ("2048", {"minimum": 2048}, 2048),
        ("65535", {"zero": True, "maximum": 65535}, 65535),
        ("0.25", {"kind": float}, 0.25),
        ("0", {"kind": float, "zero": True}, 0.0),
    ],
)
def test_positiveNumberTakes(text, bounds, value):
    assert positiveNumber(text, **bounds) == value


@pytest.mark.parametrize(
    "text, bounds, message",
    [
        ("0", {}, "--n must be a whole number of at least 1, not '0'"),
        ("-1", {"zero": True}, "--n must be a whole number of at least 0, not '-1'"),
        ("abc", {}, "--n must be a whole number of at least 1, not 'abc'"),
        ("1.5", {}, "--n must be a whole number of at least 1, not '1.5'"),
        ("2047", {"minimum": 2048}, "--n must be a whole number of at least 2048, not '2047'"),
        (
            "70000",
            {"zero": True, "maximum": 65535},
            "--n must be a whole number from 0 to 65535, not '70000'",
        ),
        ("0", {"kind": float}, "--n must be a number, positive, not '0'"),
        ("-0.5", {"kind": float, "zero": True}, "--n must be a number, positive or 0, not '-0.5'"),
        ("inf", {"kind": float}, "--n must be a number, positive, not 'inf'"),
        ("nan", {"kind": float, "zero": True}, "--n must be a number, positive or 0, not 'nan'"),
        ("1e999", {"kind": float}, "--n must be a number, positive, not '1e999'"),
    ],
)
@pytest.mark.parametrize("error", [ValueError, usage.UsageError, argparse.ArgumentTypeError])
def test_positiveNumberRefuses(text, bounds, message, error):
    """
    Anything else raises the error the caller's framework shows as one
    line, with a message naming what was wanted and what was given.
    """
    with pytest.raises(error) as raised:
        positiveNumber(text, name="--n", error=error, **bounds)
    assert str(raised.value) == message


def test_positiveNumberWithoutAName():
    with pytest.raises(ValueError, match="^must be a whole number of at least 1, not '0'$"):
        positiveNumber("0")
