"""Request id normalisation for matching P and D legs of one request (R-P04).

The proxy hands both legs the same ``X-Request-Id``, so P and D wrap it the same way
(``cmpl-<uuid>-<index>``), but each engine appends its own random suffix of eight
hex digits. Stripping that suffix, and nothing else, gives both sides the same base id
while keeping the completion index, so the sub-requests of a multi-prompt completion stay
distinct. Like vLLM 0.33 the hex digits match in either case (C-01); unlike it, a suffix
with nothing before it, or followed by a newline, is not stripped.
"""

from __future__ import annotations

import re

__all__ = ["RANDOM_SUFFIX_HEX_DIGITS", "get_base_request_id"]

RANDOM_SUFFIX_HEX_DIGITS = 8
"""Length of the per-engine random suffix appended to every request id."""

_WITH_SUFFIX = re.compile(r"(.+)-[0-9a-fA-F]{8}", re.DOTALL)
"""The rule, as a pattern (the reference `get_base_request_id` is tested against)."""

_HEX_DIGITS = "0123456789abcdefABCDEF"


def get_base_request_id(request_id: str) -> str:
    """Return ``request_id`` without its trailing ``-<8 hex>`` suffix (either case).

    ``cmpl-<uuid>-<index>-<8hex>`` becomes ``cmpl-<uuid>-<index>``. Only one suffix is
    stripped, only when something precedes it, and any other id is returned unchanged.
    (The same rule as `_WITH_SUFFIX.fullmatch`, without the regex: it runs several times
    per pushed request.)
    """
    if (
        len(request_id) > RANDOM_SUFFIX_HEX_DIGITS + 1
        and request_id[-RANDOM_SUFFIX_HEX_DIGITS - 1] == "-"
        and not request_id[-RANDOM_SUFFIX_HEX_DIGITS:].strip(_HEX_DIGITS)
    ):
        return request_id[: -RANDOM_SUFFIX_HEX_DIGITS - 1]
    return request_id
