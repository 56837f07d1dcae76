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
import sys
from collections.abc import Callable

import atheris

from kvhandoff.protocol import ec_config, ec_publication, ec_wire, handshake, notifs, push_wire
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


DECODERS: list[tuple[Callable[[bytes], object], tuple[type[BaseException], ...]]] = [
    (lambda d: push_wire.decode_push_reg(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: notifs.parse_notif(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: notifs.decode_heartbeat(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: notifs.decode_completion_notif(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: notifs.decode_write_failed(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: ec_wire.decode_xfer_req(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: ec_wire.decode_xfer_ack(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: ec_wire.decode_producer_message(d, peer="fuzz"), (RemoteProtocolError,)),
    (lambda d: handshake.decode_handshake(d, peer="fuzz"), (RemoteProtocolError,)),
    (_publication, (RemoteProtocolError,)),
    (_extra_config, (LocalProtocolError, ValueError)),
    (_transfer_config, (LocalProtocolError, ValueError)),
]


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
    atheris.Setup(args, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
