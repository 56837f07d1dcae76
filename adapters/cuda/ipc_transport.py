"""A `PushTransport` that WRITEs to same-host peers through CUDA IPC (issue 18).

`IpcPushTransport(inner, ...)` wraps the NIXL transport and delegates everything to it
(`nixl_passthrough.py`), except:

- D (``export=True``): after `connect` it sends its `IpcExport` (one IPC handle
  per KV allocation) to every rank of the peer as one notif, when the peer advertises
  ``cuda_ipc`` (a stock vLLM P never receives one); `advertise` adds it to this rank's.
- P: `get_new_notifs` takes exports out of the notif stream (the push machines never see
  them) and keeps the latest per sender agent. The first `write_blocks` to that D rank
  creates its `push.ipc_peer` instance and opens the handles once (`OpenedPeer`); when
  host, GPU or peer access, regions or CUDA say no, the refusal is logged once and that
  rank stays on NIXL (`nixl_only`, the fallback) until D sends a new export. WRITEs of
  whole blocks to an opened rank are queued (`ipc_launches.py`): the writer's
  `flush_writes`, at the end of its pass, launches ONE gather-scatter kernel per D rank
  for every queued request (or `launch_every` queued WRITEs launch at once) on the
  peer's copy stream, ending in an event. Each launch is a `push.write_batch` instance:
  the writer's `complete_writes` asks its event, and once it fired the requests'
  completion notifs leave through NIXL (one bundle toward a D that speaks B-13), and
  only then does `poll` say DONE. The kernel is the cuda.core one (`ipc_gather.py`)
  where it loads, else Triton's (`kernel` picks). A request released before its launch
  never lands; one released after it sends no notif.
- `forget` (D gone, B-08) closes the rank's instance: its queued WRITEs and its running
  launches fail (each waits for its kernel), the allocations are unmapped, then the NIXL
  agents are forgotten: P never touches a dead D's memory.

Threads (R-P08, issue 26 item 2): the writer thread owns this transport's state, as it
owns the NIXL batcher's: the peers' instances and the launches run on the writer's bus
(`bind_bus`), and only the writer queues, launches, completes, sends completion notifs
and unmaps. The main thread's `poll` reads what the writer published on a handle and
its `release` sets the handle's flag. No lock.

Source KV readiness: the kernel runs on the transport's own stream after the device's
default stream (an engine calls `request_finished` after its step synchronised).
Several GPUs of one host (issue 29): D's GPU is found by PCI bus id and the route is
chosen once per peer (`ipc_route.choose_route`): the kernel on one GPU, the kernel or the
copy engine across GPUs with peer access enabled, NIXL without peer access; only the
single-GPU case has been run.

Nothing here imports torch, Triton or cuda.bindings before a D's export is opened. The
handle, launch and counter records are in `ipc_handles.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.cuda.ipc_export import (
    IPC_EXPORT_PREFIX,
    IpcExport,
    build_export,
    decode_export,
    encode_export,
)
from kvhandoff.adapters.cuda.ipc_handles import IpcHandle, IpcStats
from kvhandoff.adapters.cuda.ipc_launches import IpcLaunches, IpcLaunchIO, launch_group
from kvhandoff.adapters.cuda.ipc_runtime import IpcError
from kvhandoff.adapters.cuda.nixl_passthrough import NixlPassthrough
from kvhandoff.adapters.nixl.push_transport import NixlPushTransport
from kvhandoff.adapters.push_transport import EngineInfo, Routes, TransferHandle, XferState
from kvhandoff.machines.push.ipc_peer import (
    IPC_PEER,
    CloseMappings,
    ExportOffered,
    IpcPeerCtx,
    MappingsClosed,
    MappingsOpened,
    MappingsRefused,
    PeerForgotten,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.protocol.errors import KvHandoffError, RemoteProtocolError
from kvhandoff.protocol.handshake import EXT_CUDA_IPC, EngineHandshake
from kvhandoff.protocol.member_routing import MemberSlot
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk

if TYPE_CHECKING:
    from kvhandoff.adapters.cuda.ipc_peer import KernelChoice, OpenedPeer
    from kvhandoff.adapters.cuda.ipc_route import CrossDevice

__all__ = ["IpcHandle", "IpcPushTransport", "IpcStats", "Path"]

log = logging.getLogger(__name__)

Path = Literal["cuda_ipc", "nixl"]


PeerOpener = Callable[
    [IpcExport, "Sequence[MemberSlot]", int, "KernelChoice", "CrossDevice"], "OpenedPeer"
]
"""(export, local slots, device, kernel, cross-device route) -> the opened D rank."""


def _open_peer(
    export: IpcExport,
    slots: Sequence[MemberSlot],
    device: int,
    kernel: KernelChoice,
    cross_device: CrossDevice,
) -> OpenedPeer:
    from kvhandoff.adapters.cuda.ipc_peer import OpenedPeer  # imports torch: only now

    return OpenedPeer(export, slots, device, kernel, cross_device)


class IpcPushTransport(NixlPassthrough):
    """The NIXL transport plus same-host CUDA IPC WRITEs (see the module doc)."""

    def __init__(
        self,
        inner: NixlPushTransport,
        *,
        device: int = 0,
        export: bool = False,
        launch_every: int = 0,
        poll_interval_s: float = 100e-6,
        wait_launches: bool = True,
        kernel: KernelChoice = "auto",
        cross_device: CrossDevice = "auto",
        clock: Callable[[], float] = real_clock,
        open_peer: PeerOpener | None = None,
    ) -> None:
        super().__init__(inner)
        self._open_peer = open_peer or _open_peer
        """Maps a D rank's export here (`OpenedPeer`; a stand-in in CPU tests)."""
        self.cross_device: CrossDevice = cross_device
        """How a D on another GPU with peer access is copied to (`ipc_route`)."""
        self.kernel: KernelChoice = kernel
        """The gather-scatter kernel of opened peers (`ipc_peer.KernelChoice`)."""
        self.device = device
        self.write_poll_interval_s: float | None = poll_interval_s
        """How soon the writer asks a running launch's event again: a 32 MiB launch ends
        in tens of microseconds, a 1 GiB one within a millisecond."""
        self.wait_launches = wait_launches
        """`complete_writes` waits for the running launches instead of asking their
        events once: the writer's pass ends when its copies do, and their notifs leave
        at once (on: 0.248-0.260 of a raw WRITE against 0.219-0.236 polling every
        100 µs, H100, bench/RESULTS.md). The wait is bounded by the bytes in flight at
        the GPU's copy rate (about 1 ms per GiB); new WRITEs would queue behind them on
        the copy stream anyway, and the writer's other inputs wait that long at most."""
        self._export: bytes | None = None
        if export:
            try:
                self._export = encode_export(build_export(inner.layout.slots, device))
            except IpcError as exc:
                log.warning("not exporting KV through CUDA IPC: %s", exc)
        self.clock = clock
        self._offers: dict[str, bytes] = {}  # sender agent -> its latest export
        self._mapped: dict[str, OpenedPeer] = {}  # the opened ranks' mappings
        self._launch_io = IpcLaunchIO(self._mapped.get, inner.send_notifs)
        self.launches: IpcLaunches = IpcLaunches(
            self._launch_io,
            post_every=launch_every,
            cancels_in_flight=False,
        )
        """Queued WRITEs to opened ranks and their launches. With `launch_every` K, the
        K-th WRITE queued for one D rank launches those K at once, copying while the
        writer still matches the pass's other requests; 0: a pass's WRITEs launch when it
        ends (`flush_writes`)."""
        self.stats = IpcStats(self.launches)
        self.bus = EventBus()
        """`push.ipc_peer` instances, one per D rank that sent an export: this
        transport's own bus until `bind_bus` gives it the writer's."""
        self._bind_peers(self.bus)

    def bind_bus(self, bus: EventBus) -> None:
        """The writer's bus: the NIXL batches, the launches and the peers run on it."""
        if self.bus.live(IPC_PEER):
            raise KvHandoffError("cannot move CUDA IPC peers to another bus once opened")
        self.inner.bind_bus(bus)
        self.launches.bind(bus)
        self.bus = bus
        self._bind_peers(bus)

    def _bind_peers(self, bus: EventBus) -> None:
        if IPC_PEER.name not in bus.kinds():
            bus.register(IPC_PEER)
        bus.handle(CloseMappings, self._close_mappings)

    def advertise(self, extensions: Sequence[str], auth_key_id: str) -> None:
        self.inner.advertise((*extensions, EXT_CUDA_IPC), auth_key_id)

    # -- connection ------------------------------------------------------------------------

    def connect(self, engine: EngineHandshake, routes: Routes) -> EngineInfo:
        info = self.inner.connect(engine, routes)
        if self._export is not None and EXT_CUDA_IPC in info.extensions:
            for rank in range(len(info.ranks)):
                try:
                    self.inner.send_notif(info.engine_id, rank, self._export)
                except KvHandoffError as exc:
                    log.warning("IPC export to %s rank %d not sent: %s", info.engine_id, rank, exc)
        return info

    def forget(self, engine_id: str) -> None:
        """Writer thread (B-08): close every opened rank of `engine_id`, then let NIXL
        forget it."""
        now = self.clock()
        for inst in self.bus.instances(IPC_PEER):
            if inst.ctx.key.rpartition("/")[0] == engine_id:
                self.bus.dispatch(IPC_PEER, inst.ctx.key, PeerForgotten(), now)
        self.inner.forget(engine_id)

    def _close_mappings(self, _inst: Any, effect: CloseMappings) -> None:
        """Fail the rank's queued and running launches (waiting for each kernel), then
        unmap its allocations."""
        key = effect.key
        self.launches.fail_group(key, "D rank closed (forgotten or re-exported)", self.bus.now)
        peer = self._mapped.pop(key, None)
        if peer is not None:
            peer.close()
        self.bus.dispatch(IPC_PEER, key, MappingsClosed(), self.bus.now)

    def path(self, engine_id: str, rank: int) -> Path:
        """Which path WRITEs to this rank take now (the writer's view)."""
        ready = self.bus.has_tag(IPC_PEER, launch_group(engine_id, rank), "ipc_ready")
        return "cuda_ipc" if ready else "nixl"

    def _opened(self, engine_id: str, rank: int) -> OpenedPeer | None:
        """The rank's mapping, opening D's export the first time (None: use NIXL)."""
        key = launch_group(engine_id, rank)
        inst = self.bus.get(IPC_PEER, key)
        if inst is not None and inst.has("ipc_ready"):
            return self._mapped[key]
        now = self.clock()
        if inst is None:
            info = self.inner.engine(engine_id)
            offer = None if info is None else self._offers.get(info.agent(rank))
            if offer is None:
                return None  # no export (yet): NIXL, and ask again next time
            inst = self.bus.create(IPC_PEER, IpcPeerCtx(key, offer), now)
        if not inst.has("openable"):
            return None
        try:
            export = decode_export(inst.ctx.export)
            peer = self._open_peer(
                export, self.inner.layout.slots, self.device, self.kernel, self.cross_device
            )
        except Exception as exc:  # any reason at all: this rank stays on NIXL
            self.stats.refused_peers[key] = str(exc)
            log.warning("CUDA IPC to %s rank %d refused, using NIXL: %s", engine_id, rank, exc)
            self.bus.dispatch(IPC_PEER, key, MappingsRefused(str(exc)), now)
            return None
        self.stats.opened_peers += 1
        self.stats.kernel = peer.kernel
        self.stats.routes[key] = peer.route
        self._mapped[key] = peer
        self.bus.dispatch(IPC_PEER, key, MappingsOpened(), now)
        return peer

    # -- notifs ----------------------------------------------------------------------------

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        notifs = self.inner.get_new_notifs()
        kept = []
        for sender, message in notifs:
            if message.startswith(IPC_EXPORT_PREFIX):
                self._offers[sender] = message
                self._offer_again(sender, message)
            else:
                kept.append((sender, message))
        return kept

    def _offer_again(self, sender: str, message: bytes) -> None:
        """A live instance of the sender's rank hears of its new export."""
        now = self.clock()
        for inst in self.bus.instances(IPC_PEER):
            engine_id, _, rank = inst.ctx.key.rpartition("/")
            info = self.inner.engine(engine_id)
            if info is None or int(rank) >= len(info.ranks) or info.agent(int(rank)) != sender:
                continue
            try:
                self.bus.dispatch(IPC_PEER, inst.ctx.key, ExportOffered(message), now)
            except RemoteProtocolError as exc:
                log.warning("IPC export from %s not taken: %s", sender, exc)

    # -- WRITEs ----------------------------------------------------------------------------

    def write_blocks(
        self,
        engine_id: str,
        rank: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
        *,
        local_chunk: Chunk = WHOLE,
        remote_chunk: Chunk = WHOLE,
    ) -> TransferHandle:
        if local_chunk == WHOLE and remote_chunk == WHOLE:
            peer = self._opened(engine_id, rank)
            if peer is not None:
                peer.check_ids(local_block_ids, remote_block_ids)
                self.stats.ipc_writes += 1
                return self.launches.queue(
                    IpcHandle(
                        engine_id, rank, tuple(local_block_ids), tuple(remote_block_ids), notif
                    )
                )
        self.stats.nixl_writes += 1
        return self.inner.write_blocks(
            engine_id,
            rank,
            local_block_ids,
            remote_block_ids,
            notif,
            local_chunk=local_chunk,
            remote_chunk=remote_chunk,
        )

    def flush_writes(self) -> list[tuple[str, KvHandoffError]]:
        """End of a writer pass: launch the queued IPC WRITEs, one kernel per D rank, and
        post the WRITEs queued on NIXL, one transfer per D rank (B-13)."""
        errors = self.launches.flush()
        errors.extend(self.inner.flush_writes())
        return errors

    def complete_writes(self, now: float) -> int:
        """Writer thread: settle the launches and NIXL transfers that ended (their
        completion notifs leave here); returns how many are still in flight."""
        if self.wait_launches:
            io = self._launch_io
            for transfer in self.launches.in_flight():
                io.wait(transfer)
        return self.launches.complete(now) + self.inner.complete_writes(now)

    def poll(self, handle: TransferHandle) -> XferState:
        """What the writer published: "PROC" until the request's launch ended and its
        notif left."""
        if isinstance(handle, IpcHandle):
            return handle.xfer_status
        return self.inner.poll(handle)

    def release(self, handle: TransferHandle) -> None:
        """A request queued for a launch is never launched; one under a running kernel
        keeps its notif back (a launch cannot be stopped)."""
        if isinstance(handle, IpcHandle):
            self.launches.release(handle)
        else:
            self.inner.release(handle)
