"""Assertions shared by the test modules."""

import pytest


def raises_mentioning(fn, *substrings, exc=ValueError) -> str:
    """``fn()`` raises ``exc`` whose message contains every one of ``substrings``; returns the message."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for s in substrings:
        assert s in msg, f"{s!r} not in error message {msg!r}"
    return msg
