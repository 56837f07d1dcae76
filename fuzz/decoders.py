"""Coverage-guided fuzzing of every decoder of untrusted bytes, with atheris.

    make fuzz                       # 1,000,000 inputs over all decoders
    python fuzz/decoders.py -runs=N

Each input is routed by its first byte to one decoder; anything but the documented error
types (`RemoteProtocolError` for bytes from a peer; `LocalProtocolError` / `ValueError`
for local configuration) is a finding and stops the run.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
from collections.abc import Callable

import atheris

from kvhandoff.protocol import (
    ec_config,
    ec_publication,
    ec_wire,
    handshake,
    nixl_wire,
    notifs,
    push_wire,
)
from kvhandoff.protocol.auth import ClusterKey
from kvhandoff.protocol.errors import LocalProtocolError, RemoteProtocolError


def _json(data: bytes) -> object:
    try:
        return json.loads(data.decode("utf-8", "replace"))
    except ValueError:
        return None


def _extra_config(data: bytes) -> None:
    obj = _json(data)
    if isinstance(obj, dict):
        ec_config.parse_ec_extra_config(obj, ec_role="ec_both", env={})


def _transfer_config(data: bytes) -> None:
    ec_config.parse_ec_transfer_config(data)


def _publication(data: bytes) -> None:
    ec_publication.parse_ec_transfer_params(_json(data), peer="fuzz")


_FUZZ_KEY = ClusterKey(b"fuzz-cluster-key-0123456789")

DECODERS: list[tuple[Callable[[bytes], object], tuple[type[BaseException], ...]]] = [
    (lambda d: push_wire.decode_push_reg(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: notifs.parse_notif(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: notifs.decode_heartbeat(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: notifs.decode_completion_notif(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: notifs.decode_write_failed(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: ec_wire.decode_xfer_req(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: ec_wire.decode_xfer_ack(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: ec_wire.decode_xfer_done(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: ec_wire.decode_producer_message(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: handshake.decode_handshake(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: handshake.decode_engine_handshake(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: nixl_wire.decode_meta_request(d, peer="fuzz"), (RemoteProtocolError,)),
    (
        lambda d: handshake.decode_handshake(d, peer="fuzz", slot=(2, 1, 1, 0)),
        (RemoteProtocolError,),
    ),
    (lambda d: _FUZZ_KEY.open("fuzz", d), (RemoteProtocolError,)),
    (_publication, (RemoteProtocolError,)),
    (_extra_config, (LocalProtocolError, ValueError)),
    (_transfer_config, (LocalProtocolError, ValueError)),
    (lambda d: ec_wire.decode_mem_descriptor(d, peer="fuzz"), (RemoteProtocolError,)),
]


# -- structure-aware mutation of the encoder-cache decoders' input (S-01) ------------------
# Byte-level mutation rarely builds deep structure: one million inputs never nested 4,000
# arrays inside a valid XferReq. With probability 1/3 the mutator below starts from a
# valid EC message and adds structure: an unknown field nested thousands deep, a header
# announcing billions of elements, or a field of the wrong type.

_EC_ROUTES = [
    i for i, (decoder, _) in enumerate(DECODERS) if "ec_wire" in decoder.__code__.co_names
]


def _ec_seed_messages() -> list[bytes]:
    from kvhandoff.protocol.ec_status import XferStatus

    req = ec_wire.XferReq("mm", "c" * 64, "s", transfer_id="6f1c2a9e", num_blocks=2, size_bytes=16)
    done = ec_wire.XferDone("mm", "6f1c2a9e", True)
    ack = ec_wire.XferAck("mm", XferStatus.NACK_MISSING, transfer_id="6f1c2a9e")
    stock_req = ec_wire.XferReq("mm", "c" * 64, "s")  # vLLM 0.33's form (C-03)
    stock_ok = ec_wire.XferAck(
        "mm",
        XferStatus.OK,
        "s",
        [0, 1],
        b"md",
        ec_wire.encode_mem_descriptor(4096, 8, 4),
    )
    return [
        ec_wire.encode_xfer_req(req),
        ec_wire.encode_xfer_done(done),
        ec_wire.encode_xfer_ack(ack),
        ec_wire.encode_xfer_req(stock_req),
        ec_wire.encode_xfer_ack(stock_ok),
    ]


_EC_SEEDS = _ec_seed_messages()
_EC_PAYLOADS = (b"\x91", b"\x81\xa1k", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xc1")


def _ec_structured(rng: random.Random, max_size: int) -> bytes:
    base = rng.choice(_EC_SEEDS)
    extra = rng.choice(_EC_PAYLOADS)
    depth = rng.randint(1, 6000) if len(extra) <= 3 else 1
    body = bytes([base[0] + 1]) + base[1:] + b"\xa3zzz" + extra * depth + b"\xc0"
    route = bytes([rng.choice(_EC_ROUTES)])
    return (route + body)[:max_size]


def custom_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    if rng.random() < 1 / 3:
        return _ec_structured(rng, max_size)
    return bytes(atheris.Mutate(data, max_size))


def test_one_input(data: bytes) -> None:
    if not data:
        return
    decoder, allowed = DECODERS[data[0] % len(DECODERS)]
    with contextlib.suppress(*allowed):
        decoder(data[1:])


def main() -> None:
    args = sys.argv
    if not any(a.startswith("-runs=") for a in args):
        args = [*args, "-runs=1000000"]
    atheris.instrument_all()  # the protocol modules load through the editable link tree
    atheris.Setup(args, test_one_input, custom_mutator=custom_mutator)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
