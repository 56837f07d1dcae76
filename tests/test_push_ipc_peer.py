"""`push.ipc_peer` (issue 18): the declared lifecycle of one D rank's CUDA IPC mapping on
P, model-tested, and driven by the IPC transport wrapper without a GPU."""

from __future__ import annotations

from hypothesis import strategies as st
from ipc_stub import StubNixl
from test_push_ipc_fallback import SLOTS, _export

from kvhandoff.adapters.cuda import ipc_runtime
from kvhandoff.adapters.cuda.ipc_export import encode_export
from kvhandoff.adapters.cuda.ipc_transport import IpcPushTransport
from kvhandoff.machines.push.ipc_peer import IPC_PEER, ExportOffered, MappingsRefused
from kvhandoff.testing import run_model_test


def test_ipc_peer_model() -> None:
    run_model_test(
        IPC_PEER,
        context=st.fixed_dictionaries({"export": st.binary(max_size=4)}),
        payloads={
            ExportOffered: st.builds(ExportOffered, st.binary(max_size=4)),
            MappingsRefused: st.builds(MappingsRefused, st.text(max_size=4)),
        },
        max_examples=150,
    )


def test_B_08_a_refused_rank_retries_a_new_export_and_is_closed_when_forgotten() -> None:
    stub = StubNixl(slots=SLOTS)
    ipc = IpcPushTransport(stub, device=0)  # type: ignore[arg-type]
    stub.inbox = [("d-agent", encode_export(_export("elsewhere/boot")))]
    ipc.get_new_notifs()
    ipc.write_blocks("D", 0, [1], [2], b"n")
    assert ipc.bus.has_tag(IPC_PEER, "D/0", "nixl_only")
    # D sends a new export (say, from this host): the rank becomes openable again and the
    # next WRITE tries it (here it is refused again: no usable GPU named in it).
    stub.inbox = [("d-agent", encode_export(_export(ipc_runtime.host_identity())))]
    ipc.get_new_notifs()
    assert ipc.bus.has_tag(IPC_PEER, "D/0", "openable")
    ipc.write_blocks("D", 0, [1], [2], b"n")
    assert ipc.bus.has_tag(IPC_PEER, "D/0", "nixl_only")
    assert len(stub.writes) == 2
    ipc.forget("D")
    assert ipc.bus.get(IPC_PEER, "D/0") is None
