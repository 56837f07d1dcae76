"""A `PushTransport` that WRITEs to same-host peers through CUDA IPC (issue 18).

`IpcPushTransport(inner, ...)` wraps the NIXL transport and delegates everything to it
(`nixl_passthrough.py`), except:

- D (``export=True``): after `connect` it sends its `IpcExport` (one IPC handle
  per KV allocation) to every rank of the peer as one notif, when the peer advertises
  ``cuda_ipc`` (a stock vLLM P never receives one); `advertise` adds it to this rank's.
- P: `get_new_notifs` takes exports out of the notif stream (the push machines never see
  them) and keeps the latest per sender agent. The first `write_blocks` to that D rank
  creates its `push.ipc_peer` instance (on this transport's own bus) and opens the
  handles once (`OpenedPeer`); when host, GPU or peer access, regions or CUDA say no, the
  refusal is logged once and that rank stays on NIXL (`nixl_only`, the fallback) until D
  sends a new export. WRITEs of whole
  blocks to an opened rank are queued, not posted: the next `progress` / `poll` (main
  thread) or `get_new_notifs` (writer thread) launches ONE gather-scatter kernel per D
  rank for every queued request (or the writer does, every `launch_every` queued
  WRITEs) on the peer's copy stream, ending in an event; the requests' completion notifs
  leave through NIXL only after that event fired (one bundle per launch toward a D that
  speaks B-13), and only then does their `poll` say DONE. The kernel is the cuda.core one
  (`ipc_gather.py`) where it loads, else Triton's (`kernel` picks). A request
  released before its launch never lands; one released after it sends no notif.
- `forget` (D gone, B-08) closes the rank's instance: it waits for that rank's kernels,
  fails their requests, unmaps the allocations, then the NIXL agents are forgotten: P
  never touches a dead D's memory.

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
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.cuda.ipc_export import (
    IPC_EXPORT_PREFIX,
    build_export,
    decode_export,
    encode_export,
)
from kvhandoff.adapters.cuda.ipc_handles import IpcBatch, IpcHandle, IpcStats
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
from kvhandoff.protocol.tp_mapping import WHOLE, Chunk

if TYPE_CHECKING:
    from kvhandoff.adapters.cuda.ipc_peer import KernelChoice, OpenedPeer
    from kvhandoff.adapters.cuda.ipc_route import CrossDevice

__all__ = ["IpcHandle", "IpcPushTransport", "IpcStats", "Path"]

log = logging.getLogger(__name__)

Path = Literal["cuda_ipc", "nixl"]


class IpcPushTransport(NixlPassthrough):
    """The NIXL transport plus same-host CUDA IPC WRITEs (see the module doc)."""

    def __init__(
        self,
        inner: NixlPushTransport,
        *,
        device: int = 0,
        export: bool = False,
        launch_every: int = 0,
        notifier: bool = False,
        launch_at_flush: bool = False,
        kernel: KernelChoice = "auto",
        cross_device: CrossDevice = "auto",
        clock: Callable[[], float] = real_clock,
    ) -> None:
        super().__init__(inner)
        self.cross_device: CrossDevice = cross_device
        """How a D on another GPU with peer access is copied to (`ipc_route`)."""
        self.kernel: KernelChoice = kernel
        """The gather-scatter kernel of opened peers (`ipc_peer.KernelChoice`)."""
        self.launch_every = launch_every
        """Queued WRITEs to one D rank that launch a kernel at once from `write_blocks`
        (copying while the writer still matches the pass's other requests; the writer only
        launches, completions stay with `progress` / `poll`); 0: never, a pass's WRITEs
        launch at the next `progress` / `poll` / `get_new_notifs`. With the cuda.core
        kernel 4, 8 and 16 measured within the noise of 0 on the H200, the launches'
        host time eating the overlap (bench/RESULTS.md): 0 stays the default."""
        self._use_notifier = notifier
        """Send completion notifs from a thread waiting on each launch's event instead of
        at the next `poll` / `get_new_notifs` (off: it measured slower)."""
        self.launch_at_flush = launch_at_flush
        """Launch a pass's queued WRITEs from the writer when the pass ends (`flush_writes`)
        instead of at the next `progress` / `poll` / `get_new_notifs` (measured no better,
        with either kernel)."""
        self.device = device
        self.stats = IpcStats()
        self._lock = threading.RLock()
        """Guards the queues, batches, offers and the peer bus; held only briefly, so a
        writer queueing a WRITE never waits behind a launch."""
        self._launch_lock = threading.RLock()
        """Held while launching and while unmapping a peer (never unmap under a launch, and
        a release waits for a launch in progress). Lock order: `_launch_lock`, then `_lock`."""
        self._export: bytes | None = None
        if export:
            try:
                self._export = encode_export(build_export(inner.layout.slots, device))
            except IpcError as exc:
                log.warning("not exporting KV through CUDA IPC: %s", exc)
        self.clock = clock
        self.bus = EventBus()
        """`push.ipc_peer` instances, one per D rank that sent an export (under `_lock`)."""
        self.bus.register(IPC_PEER)
        self.bus.handle(CloseMappings, self._close_mappings)
        self._offers: dict[str, bytes] = {}  # sender agent -> its latest export
        self._mapped: dict[str, OpenedPeer] = {}  # the opened ranks' mappings
        self._queued: dict[str, list[IpcHandle]] = {}
        self._batches: list[IpcBatch] = []
        self._wake = threading.Condition(self._lock)
        self._notifier: threading.Thread | None = None
        self._closed = False

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
        with self._launch_lock, self._lock:
            now = self.clock()
            for inst in self.bus.instances(IPC_PEER):
                if inst.ctx.key.rpartition("/")[0] == engine_id:
                    self.bus.dispatch(IPC_PEER, inst.ctx.key, PeerForgotten(), now)
        self.inner.forget(engine_id)

    def _close_mappings(self, _inst: Any, effect: CloseMappings) -> None:
        key = effect.key
        self._fail_rank(key)
        peer = self._mapped.pop(key, None)
        if peer is not None:
            peer.close()
        self.bus.dispatch(IPC_PEER, key, MappingsClosed(), self.bus.now)

    def _fail_rank(self, key: str) -> None:
        for handle in self._queued.pop(key, []):
            handle.xfer_status = "ERR"
        for batch in [b for b in self._batches if b.key == key]:
            batch.wait()  # never unmap under a running kernel
            for handle in batch.handles:
                handle.xfer_status = "ERR"
            self._batches.remove(batch)

    def path(self, engine_id: str, rank: int) -> Path:
        """Which path WRITEs to this rank take now."""
        with self._lock:
            ready = self.bus.has_tag(IPC_PEER, f"{engine_id}/{rank}", "ipc_ready")
            return "cuda_ipc" if ready else "nixl"

    def _opened(self, engine_id: str, rank: int) -> OpenedPeer | None:
        """The rank's mapping, opening D's export the first time (None: use NIXL)."""
        key = f"{engine_id}/{rank}"
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
            from kvhandoff.adapters.cuda.ipc_peer import OpenedPeer

            export = decode_export(inst.ctx.export)
            peer = OpenedPeer(
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
                with self._launch_lock, self._lock:  # it may unmap the rank's old export
                    self._offers[sender] = message
                    self._offer_again(sender, message)
            else:
                kept.append((sender, message))
        if self._queued or self._batches:
            self._progress()
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
            handle = self._queue_ipc(engine_id, rank, local_block_ids, remote_block_ids, notif)
            if handle is not None:
                return handle
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

    def _queue_ipc(
        self,
        engine_id: str,
        rank: int,
        local_block_ids: Sequence[int],
        remote_block_ids: Sequence[int],
        notif: bytes,
    ) -> IpcHandle | None:
        """Queue a WRITE to an opened rank (None: that rank takes NIXL)."""
        with self._lock:
            peer = self._opened(engine_id, rank)
            if peer is None:
                return None
            peer.check_ids(local_block_ids, remote_block_ids)
            handle = IpcHandle(
                engine_id, rank, tuple(local_block_ids), tuple(remote_block_ids), notif
            )
            queue = self._queued.setdefault(f"{engine_id}/{rank}", [])
            queue.append(handle)
            self.stats.ipc_writes += 1
            full = bool(self.launch_every) and len(queue) >= self.launch_every
        if full:
            self._launch_queued()  # only launch: completions are the main thread's
        return handle

    def poll(self, handle: TransferHandle) -> XferState:
        """A launched handle asks CUDA only whether the oldest unfinished launch ended
        (launches on one stream end in order): an engine polling many requests pays one
        event query each, not a walk of every queue."""
        if not isinstance(handle, IpcHandle):
            return self.inner.poll(handle)
        if handle.xfer_status == "PROC":
            with self._lock:
                head = self._batches[0] if self._batches else None
                ended = head is not None and head.ended()
            if handle.batch is None or ended:
                self._progress()
        return handle.xfer_status

    def release(self, handle: TransferHandle) -> None:
        if not isinstance(handle, IpcHandle):
            self.inner.release(handle)
            return
        with self._launch_lock, self._lock:  # not while its launch is being queued
            handle.released = True
            queued = self._queued.get(f"{handle.engine_id}/{handle.rank}", [])
            if handle in queued:
                queued.remove(handle)  # never launched: it never lands

    def flush_writes(self) -> list[tuple[str, KvHandoffError]]:
        """End of a writer pass: post the WRITEs queued on NIXL, one transfer per D rank
        (B-13). Queued IPC WRITEs launch at the next `progress`, `poll` or
        `get_new_notifs`: launching here, from the writer (`launch_at_flush`), measured no
        better on the H200 (bench/RESULTS.md)."""
        if self.launch_at_flush and self._queued:
            self._launch_queued()
        return self.inner.flush_writes()

    def flush(self) -> None:
        """Launch what is queued and send the notifs of finished launches."""
        self._progress()

    def progress(self) -> None:
        """Main thread, first in every engine step: launch what is queued, send the
        completion notifs of launches whose event fired (one event query when a launch
        is in flight)."""
        if self._queued or self._batches:
            self._progress()

    def close(self) -> None:
        """Stop the notifier thread (the transport itself stays usable)."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
        if self._notifier is not None:
            self._notifier.join(timeout=10.0)

    def _notify_loop(self) -> None:
        """Send each batch's completion notifs as soon as its event fired, without
        waiting for the engine's next `poll` (the wait releases the GIL)."""
        while True:
            with self._lock:
                while not self._batches and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                batch = self._batches[0]
            batch.wait()
            with self._lock:
                if self._batches and self._batches[0] is batch:
                    self._batches.pop(0)
                    self._complete(batch)

    def _progress(self) -> None:
        """Launch what is queued, then complete the launches whose event fired, in
        order."""
        with self._launch_lock:
            self._launch_queued()
            with self._lock:
                while self._batches and self._batches[0].ended():
                    self._complete(self._batches.pop(0))

    def _launch_queued(self) -> None:
        """Launch every queued WRITE, one kernel per D rank (the queue lock is held only
        to take the queues: the writer keeps queueing meanwhile)."""
        with self._launch_lock:
            with self._lock:
                work = [
                    (key, self._queued.pop(key), self._mapped.get(key))
                    for key in list(self._queued)
                ]
            for key, queued, peer in work:
                handles = [h for h in queued if not h.released]  # a release waits for us
                if handles and peer is not None:
                    self._launch(key, peer, handles)

    def _complete(self, batch: IpcBatch) -> None:
        """The launch's event fired: its requests' completion notifs leave, as one bundle
        toward a D rank that speaks B-13 (a launch writes to one D rank)."""
        peer = self._mapped.get(batch.key)
        if peer is not None:
            peer.retire(batch.event)
        live = [h for h in batch.handles if not h.released]
        if not live:
            return
        if batch.failed:
            for handle in live:
                handle.xfer_status = "ERR"
            return
        try:
            self.inner.send_notifs(live[0].engine_id, live[0].rank, [h.notif for h in live])
        except KvHandoffError as exc:
            log.warning("completion notifs after an IPC WRITE not sent: %s", exc)
            state: XferState = "ERR"
        else:
            state = "DONE"
        for handle in live:
            handle.xfer_status = state

    def _launch(self, key: str, peer: OpenedPeer, handles: list[IpcHandle]) -> None:
        if not handles:
            return
        local = [b for h in handles for b in h.local_ids]
        remote = [b for h in handles for b in h.remote_ids]
        try:
            # On the peer's copy stream, after P's KV writes on the engine's stream.
            event = peer.launch(local, remote)
        except (RuntimeError, KvHandoffError) as exc:
            log.warning("IPC gather-scatter launch failed: %s", exc)
            for handle in handles:
                handle.xfer_status = "ERR"
            return
        batch = IpcBatch(key, event, handles)
        with self._lock:
            self.stats.launches += 1
            for handle in handles:
                handle.batch = batch
            self._batches.append(batch)
            if self._use_notifier:
                if self._notifier is None:
                    self._notifier = threading.Thread(
                        target=self._notify_loop, name="kvhandoff-ipc-notifier", daemon=True
                    )
                    self._notifier.start()
                self._wake.notify()
