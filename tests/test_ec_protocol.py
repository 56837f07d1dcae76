"""Vocabulary of the encoder-cache P2P tier: statuses, the compatibility hash, and the
publication in `ec_transfer_params`. The control-plane messages are tested in
`test_ec_wire.py`."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.protocol.ec_publication import (
    PublishedEncoding,
    build_ec_transfer_params,
    parse_ec_transfer_params,
    publish_entry,
    unservable_entry,
)
from kvhandoff.protocol.ec_status import (
    EC_CONNECTOR_VERSION,
    NACKS,
    RETRYABLE_NACKS,
    XferStatus,
    canonical_dtype_name,
    compatibility_hash,
    is_retryable,
)
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError

HASH = compatibility_hash("0.1.0", "Qwen/Qwen3-VL-8B", "bfloat16", 8192)


# -- status vocabulary -------------------------------------------------------------------


def test_R_E08_retryable_nacks_is_exactly_not_ready() -> None:
    assert frozenset({XferStatus.NACK_NOT_READY}) == RETRYABLE_NACKS
    assert is_retryable(XferStatus.NACK_NOT_READY)
    for status in XferStatus:
        if status is not XferStatus.NACK_NOT_READY:
            assert not is_retryable(status), status


def test_C_03_statuses_are_vllm_integers_with_their_names() -> None:
    # vLLM 0.33.0's XferStatus: the same six names, the same integers on the wire (C-03).
    assert {s.name: s.value for s in XferStatus} == {
        "OK": 0,
        "NACK_MISSING": 1,
        "NACK_INCOMPAT": 2,
        "NACK_VERSION": 3,
        "NACK_INTERNAL": 4,
        "NACK_NOT_READY": 5,
    }
    assert frozenset(XferStatus) - {XferStatus.OK} == NACKS
    assert RETRYABLE_NACKS <= NACKS
    assert XferStatus["NACK_MISSING"] is XferStatus(1) is XferStatus.NACK_MISSING
    assert str(XferStatus.NACK_MISSING) == f"{XferStatus.NACK_MISSING}" == "NACK_MISSING"


def test_C_03_connector_version_is_vllms() -> None:
    assert EC_CONNECTOR_VERSION == 2


def test_C_03_compat_hash_is_vllms_digest_of_the_same_inputs() -> None:
    factors = json.dumps(
        ["0.1.0", "Qwen/Qwen3-VL-8B", "torch.bfloat16", 8192], separators=(",", ":")
    )
    assert hashlib.sha256(factors.encode()).hexdigest() == HASH


# -- compatibility hash ------------------------------------------------------------------


def test_R_E10_compat_hash_is_sha256_hex_and_deterministic() -> None:
    assert re.fullmatch(r"[0-9a-f]{64}", HASH)
    assert compatibility_hash("0.1.0", "Qwen/Qwen3-VL-8B", "bfloat16", 8192) == HASH


def test_R_E10_compat_hash_changes_with_every_field() -> None:
    variants = {
        compatibility_hash("0.1.1", "Qwen/Qwen3-VL-8B", "bfloat16", 8192),
        compatibility_hash("0.1.0", "Qwen/Qwen3-VL-4B", "bfloat16", 8192),
        compatibility_hash("0.1.0", "Qwen/Qwen3-VL-8B", "float16", 8192),
        compatibility_hash("0.1.0", "Qwen/Qwen3-VL-8B", "bfloat16", 16384),
    }
    assert len(variants) == 4
    assert HASH not in variants


def test_R_E10_compat_hash_field_boundaries_are_unambiguous() -> None:
    assert compatibility_hash("ab", "c", "float16", 2) != compatibility_hash(
        "a", "bc", "float16", 2
    )
    naive = hashlib.sha256(b"0.1.0Qwen/Qwen3-VL-8Bbfloat168192").hexdigest()
    assert naive != HASH


def test_R_E10_compat_hash_canonicalises_dtype_names() -> None:
    assert canonical_dtype_name("torch.float16") == "float16"
    assert canonical_dtype_name("half") == "float16"
    assert compatibility_hash("v", "m", "torch.bfloat16", 4) == compatibility_hash(
        "v", "m", "bfloat16", 4
    )
    assert compatibility_hash("v", "m", "half", 4) == compatibility_hash("v", "m", "float16", 4)


@pytest.mark.parametrize("bad", [0, -1, 2**64, True, 4.0, "4"])
def test_R_E10_compat_hash_rejects_bad_block_size(bad: Any) -> None:
    with pytest.raises(LocalProtocolError, match="block_size_bytes"):
        compatibility_hash("v", "m", "float16", bad)


@settings(max_examples=200)
@given(
    a=st.tuples(st.text(max_size=8), st.text(max_size=8), st.text(min_size=1, max_size=8)),
    b=st.tuples(st.text(max_size=8), st.text(max_size=8), st.text(min_size=1, max_size=8)),
    size_a=st.integers(1, 2**64 - 1),
    size_b=st.integers(1, 2**64 - 1),
)
def test_R_E10_distinct_fields_give_distinct_hashes(
    a: tuple[str, str, str], b: tuple[str, str, str], size_a: int, size_b: int
) -> None:
    same = (a[0], a[1], canonical_dtype_name(a[2]), size_a) == (
        b[0],
        b[1],
        canonical_dtype_name(b[2]),
        size_b,
    )
    assert (compatibility_hash(*a, size_a) == compatibility_hash(*b, size_b)) == same


# -- publication (R-E06) -----------------------------------------------------------------

META = {"image_grid_thw": [1, 24, 24], "num_tokens": 576}


def test_R_E06_servable_entry_round_trips() -> None:
    entry = publish_entry(META, "10.0.0.5", 5601, 576 * 8192)
    assert entry == {
        "metadata": META,
        "peer_host": "10.0.0.5",
        "peer_port": 5601,
        "size_bytes": 576 * 8192,
    }
    parsed = parse_ec_transfer_params({"mm-1": entry})
    assert parsed == {"mm-1": PublishedEncoding(META, "10.0.0.5", 5601, 576 * 8192)}


def test_R_E06_unservable_entry_has_empty_metadata_and_no_address() -> None:
    assert unservable_entry() == {"metadata": {}}
    assert parse_ec_transfer_params({"mm-2": unservable_entry()}) == {"mm-2": None}
    assert parse_ec_transfer_params(None) == {}


@pytest.mark.parametrize(
    "entry",
    [
        {"metadata": META},
        {"metadata": META, "peer_host": "h", "peer_port": 1},
        {"metadata": {}, "peer_host": "h", "peer_port": 1, "size_bytes": 1},
        {"metadata": {}, "size_bytes": 1},
        {"peer_host": "h", "peer_port": 1, "size_bytes": 1},
    ],
)
def test_R_E06_half_published_entries_are_rejected(entry: dict[str, Any]) -> None:
    with pytest.raises(RemoteProtocolError, match=r"half-published|no metadata"):
        parse_ec_transfer_params({"mm": entry}, peer="orchestrator")


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"metadata": META, "peer_host": "", "peer_port": 1, "size_bytes": 1}, "peer_host"),
        ({"metadata": META, "peer_host": "a b", "peer_port": 1, "size_bytes": 1}, "peer_host"),
        ({"metadata": META, "peer_host": "h", "peer_port": 0, "size_bytes": 1}, "peer_port"),
        ({"metadata": META, "peer_host": "h", "peer_port": True, "size_bytes": 1}, "peer_port"),
        ({"metadata": META, "peer_host": "h", "peer_port": "5601", "size_bytes": 1}, "peer_port"),
        ({"metadata": META, "peer_host": "h", "peer_port": 1, "size_bytes": 0}, "size_bytes"),
        ({"metadata": [1], "peer_host": "h", "peer_port": 1, "size_bytes": 1}, "metadata"),
        ({"metadata": {"k": object()}, "peer_host": "h", "peer_port": 1, "size_bytes": 1}, "JSON"),
        ({"metadata": {}, "extra": 1}, "unknown key"),
        ("not-an-object", "must be an object"),
    ],
)
def test_R_E06_malformed_entries_are_remote_errors(entry: Any, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        parse_ec_transfer_params({"mm": entry})


def test_R_E06_malformed_params_container_is_a_remote_error() -> None:
    with pytest.raises(RemoteProtocolError, match="must be an object"):
        parse_ec_transfer_params([("mm", {"metadata": {}})])
    with pytest.raises(RemoteProtocolError, match="mm_hash"):
        parse_ec_transfer_params({"": {"metadata": {}}})


def test_R_E06_builders_refuse_half_publication() -> None:
    with pytest.raises(LocalProtocolError, match="non-empty"):
        publish_entry({}, "h", 5601, 10)
    with pytest.raises(LocalProtocolError, match="peer_port"):
        publish_entry(META, "h", 70000, 10)


publications = st.dictionaries(
    st.text(min_size=1, max_size=16),
    st.one_of(
        st.none(),
        st.builds(
            PublishedEncoding,
            metadata=st.dictionaries(
                st.text(max_size=8), st.integers() | st.text(max_size=8), min_size=1, max_size=3
            ),
            peer_host=st.from_regex(r"[a-z0-9.\-]{1,30}", fullmatch=True),
            peer_port=st.integers(1, 65535),
            size_bytes=st.integers(1, 2**40),
        ),
    ),
    max_size=5,
)


@given(publications)
def test_R_E06_params_round_trip(encodings: dict[str, PublishedEncoding | None]) -> None:
    assert parse_ec_transfer_params(build_ec_transfer_params(encodings)) == encodings


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=10)),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=10), inner),
    max_leaves=10,
)
entry_keys = st.sampled_from(["metadata", "peer_host", "peer_port", "size_bytes", "junk"])


@settings(max_examples=300)
@given(
    st.one_of(
        json_values,
        st.dictionaries(
            st.text(max_size=10),
            st.one_of(json_values, st.dictionaries(entry_keys, json_values, max_size=5)),
            max_size=4,
        ),
    )
)
def test_R_E06_parser_on_arbitrary_json_raises_only_remote_errors(obj: Any) -> None:
    try:
        parsed = parse_ec_transfer_params(obj, peer="fuzz")
    except RemoteProtocolError as exc:
        assert exc.peer == "fuzz"
        return
    for value in parsed.values():
        assert value is None or value.size_bytes > 0
