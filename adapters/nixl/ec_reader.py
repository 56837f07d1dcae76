"""The consumer's data plane of the encoder-cache P2P tier: NIXL READs of producers'
regions into ours (R-E07, R-E11, B-08).

`ECNixlReader` executes `IssueRead` effects with one `NixlAgent` whose registered region
(ours, the READ destination) is prepared once as a block descriptor list. A producer's
agent is loaded from the metadata its `XferAck` carried, when that agent is new or its
metadata changed (a producer restarted under the same engine id): no separate handshake
(R-E11). New metadata under a known name from another producer address is refused while
READs of the known agent are in flight (S-02: agent names are self-declared; one producer
must not fail another's READs by claiming its name). Each loaded agent's lifecycle
(loaded, reading, stale, forgotten) is an `ec.producer_agent` machine on the reader's
own bus; the reader only executes its effects (`ForgetAgent`, `FailReads`). The
producer's region is prepared as descriptors too; the grant does not say how large that
region is, so the prepared list grows to cover the highest granted block.

Each posted READ's handle is an `ec.read_handle` machine on the same bus (posted,
completed, released, or failed and reported when its agent was replaced).

`poll()` reports each READ once, `(mm_hash, transfer_id, ok)`, after releasing its
handle. `release(transfer_id)` releases a READ's handle at once (NIXL cancels the DMA):
the consumer read asks for it when a quarantine ends, and frees the destination only
after. An agent whose peer went away (the control plane lost it, or NIXL said the remote
disconnected) is forgotten as soon as no READ uses it, so nothing keeps using a dead
agent (B-08); the next grant brings its metadata again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any, cast

from kvhandoff.adapters.clock import real_clock
from kvhandoff.adapters.nixl.agent import NixlAgent, NixlTransferError, PreppedBlocks, XferHandle
from kvhandoff.machines.ec.consumer_read import IssueRead
from kvhandoff.machines.ec.producer_agent import (
    EC_PRODUCER_AGENT,
    AgentCtx,
    Close,
    FailReads,
    ForgetAgent,
    MetadataChanged,
    PeerLost,
    ReadEnded,
    ReadPosted,
)
from kvhandoff.machines.ec.read_handle import (
    EC_READ_HANDLE,
    AgentReplaced,
    Completed,
    PostFailed,
    ReadHandleCtx,
    Released,
    Reported,
)
from kvhandoff.machines.runtime.bus import EventBus
from kvhandoff.machines.runtime.clock import Clock
from kvhandoff.machines.runtime.compiled import Instance
from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError, RemoteProtocolError

__all__ = ["ECNixlReader", "ReadCompletion"]

log = logging.getLogger("kvhandoff.ec.nixl_reader")

ReadCompletion = tuple[str, str, bool]
"""`(mm_hash, transfer_id, ok)` of a READ that ended."""


class ECNixlReader:
    """NIXL READs from producers' regions into the `num_blocks` blocks at `region_addr`."""

    def __init__(
        self,
        agent: NixlAgent,
        region_addr: int,
        block_size_bytes: int,
        num_blocks: int,
        *,
        clock: Clock = real_clock,
    ) -> None:
        self.agent = agent
        self.block_size_bytes = block_size_bytes
        self.num_blocks = num_blocks
        self.clock = clock
        self._local = agent.prep_local_blocks([(region_addr, block_size_bytes, num_blocks)])
        self.bus = EventBus()
        self.bus.register(EC_PRODUCER_AGENT)
        self.bus.register(EC_READ_HANDLE)
        self.bus.handle(ForgetAgent, self._forget_agent)
        self.bus.handle(FailReads, self._fail_reads)
        self.agents_loaded = 0
        self.agents_forgotten = 0
        self.post_failures = 0
        self.abandoned = 0
        self.foreign_agents = 0
        """Grants refused for naming another producer's agent (S-02)."""

    # -- posting -----------------------------------------------------------------------

    def read(self, effect: IssueRead) -> None:
        """Post the READ of `effect`; a `KvHandoffError` when it cannot be posted (the
        next `poll` then reports it failed, see `refused`)."""
        try:
            if effect.block_size_bytes != self.block_size_bytes:
                raise RemoteProtocolError(
                    f"grant of {effect.block_size_bytes}-byte blocks, ours are "
                    f"{self.block_size_bytes}"
                )
            if not effect.src_blocks or len(effect.src_blocks) != len(effect.dst_blocks):
                raise RemoteProtocolError("grant and destination differ in block count")
            if self.bus.get(EC_READ_HANDLE, effect.transfer_id) is not None:
                raise LocalProtocolError(f"READ {effect.transfer_id!r} is already in flight")
            remote = self._remote_for(effect)
            remote_list = self._remote_list(
                remote, effect.remote_base_addr, max(effect.src_blocks) + 1
            )
            handle = self.agent.read(
                self._local,
                list(effect.dst_blocks),
                remote_list,
                list(effect.src_blocks),
                notif=effect.notif,
            )
        except KvHandoffError as exc:
            self.post_failures += 1
            if isinstance(exc, NixlTransferError) and exc.peer_gone:
                self._deliver(effect.producer_agent_name, PeerLost())
            self.refused(effect)
            raise
        self._deliver(remote.key, ReadPosted(effect.peer_host, effect.peer_port))
        ctx = ReadHandleCtx(effect.transfer_id, effect.mm_hash, remote.key, handle)
        self.bus.create(EC_READ_HANDLE, ctx, self.clock())

    def refused(self, effect: IssueRead) -> None:
        """The READ of `effect` could not be posted (NIXL refused it, or a fault did): the
        next `poll` reports it failed (R-E08). A READ already posted under that transfer
        id keeps its own handle and report."""
        if self.bus.get(EC_READ_HANDLE, effect.transfer_id) is not None:
            return
        now = self.clock()
        ctx = ReadHandleCtx(effect.transfer_id, effect.mm_hash, effect.producer_agent_name)
        self.bus.create(EC_READ_HANDLE, ctx, now)
        self.bus.dispatch(EC_READ_HANDLE, ctx.key, PostFailed(), now)

    def _deliver(self, name: str, event: Any) -> None:
        """`event` to agent `name`'s machine, if it is live."""
        if self.bus.get(EC_PRODUCER_AGENT, name) is not None:
            self.bus.dispatch(EC_PRODUCER_AGENT, name, event, self.clock())

    def _unnamed(self, effect: IssueRead, metadata: bytes) -> AgentCtx | None:
        """The agent of a grant that names none (a stock vLLM producer, C-03): the one
        loaded for that producer from the same metadata; one loaded from other metadata
        is replaced (the producer restarted, R-E11)."""
        address = (effect.peer_host, effect.peer_port)
        for inst in self.bus.instances(EC_PRODUCER_AGENT):
            ctx = inst.ctx
            if (ctx.peer_host, ctx.peer_port) != address:
                continue
            if ctx.metadata == metadata:
                return ctx
            self._deliver(ctx.key, MetadataChanged())
        return None

    def _remote_for(self, effect: IssueRead) -> AgentCtx:
        name, metadata = effect.producer_agent_name, bytes(effect.producer_agent_metadata)
        if not name:
            known = self._unnamed(effect, metadata)
            if known is not None:
                return known
            loaded = self.agent.add_remote(metadata)
            if self.bus.get(EC_PRODUCER_AGENT, loaded) is not None:
                self._deliver(loaded, MetadataChanged())
            ctx = AgentCtx(loaded, metadata, effect.peer_host, effect.peer_port)
            self.agents_loaded += 1
            return self.bus.create(EC_PRODUCER_AGENT, ctx, self.clock()).ctx
        remote = self.bus.get(EC_PRODUCER_AGENT, name)
        if remote is not None and remote.ctx.metadata != metadata:
            here = (remote.ctx.peer_host, remote.ctx.peer_port)
            if here != (effect.peer_host, effect.peer_port) and self._reads_of(name):
                # S-02: another producer claims this agent's name while READs of the real
                # one are in flight: refused, so it cannot fail them by replacing it.
                self.foreign_agents += 1
                raise RemoteProtocolError(
                    f"XferAck from {effect.peer_host}:{effect.peer_port} names agent "
                    f"{name[:80]!r}, which is the producer at {here[0]}:{here[1]} with READs "
                    "in flight"
                )
            # The same agent name with new metadata: the producer restarted (R-E11).
            self._deliver(name, MetadataChanged())
            remote = None
        if remote is not None:
            return remote.ctx
        loaded = self.agent.add_remote(metadata)
        if loaded != name:
            with contextlib.suppress(KvHandoffError):
                self.agent.remove_remote(loaded)
            raise RemoteProtocolError(
                f"XferAck names agent {name!r} but carries metadata of {loaded!r}"
            )
        ctx = AgentCtx(name, metadata, effect.peer_host, effect.peer_port)
        self.agents_loaded += 1
        return self.bus.create(EC_PRODUCER_AGENT, ctx, self.clock()).ctx

    def _reads_of(self, name: str) -> bool:
        """Whether a READ from agent `name` is in flight."""
        return any(r.ctx.agent == name for r in self.bus.tagged(EC_READ_HANDLE, "in_flight"))

    def _remote_list(self, remote: AgentCtx, base: int, needed: int) -> PreppedBlocks:
        """The producer's region as prepared descriptors covering at least `needed`
        blocks: twice the old size when the producer registered that much, else exactly
        `needed`. A list a READ in flight may still use stays until the agent goes."""
        block_len = self.block_size_bytes
        lists = remote.prepped  # they go with the agent's machine
        current = cast(PreppedBlocks | None, lists.get((base, block_len)))
        if current is not None and current.layout.num_descs >= needed:
            return current
        grown = 2 * current.layout.num_descs if current is not None else 0
        prepped: PreppedBlocks | None = None
        if grown > needed:
            with contextlib.suppress(NixlTransferError):
                prepped = self.agent.prep_remote_blocks(remote.key, [(base, block_len, grown)])
        if prepped is None:
            prepped = self.agent.prep_remote_blocks(remote.key, [(base, block_len, needed)])
        lists[(base, block_len)] = prepped
        return prepped

    # -- completion ----------------------------------------------------------------------

    def poll(self, awaited: Callable[[str, str], bool]) -> list[ReadCompletion]:
        """READs that ended since the last call. `awaited(mm_hash, transfer_id)` says
        whether someone still waits for a READ; one nobody awaits is cancelled."""
        bus = self.bus
        done: list[ReadCompletion] = []
        for failed in bus.tagged(EC_READ_HANDLE, "unreported"):
            done.append((failed.ctx.mm_hash, failed.ctx.key, False))
            bus.dispatch(EC_READ_HANDLE, failed.key, Reported(), self.clock())
        for inst in bus.tagged(EC_READ_HANDLE, "in_flight"):
            read = inst.ctx
            handle = cast(XferHandle, read.handle)
            status = self.agent.poll(handle)
            if status == "PROC":
                if not awaited(read.mm_hash, read.key):
                    self.abandoned += 1  # its quarantine ended: cancel the DMA
                    self._drop(read, Released())
                continue
            error = handle.error or ""
            self._drop(read, Completed(status == "DONE"))
            if status != "DONE":
                log.warning("READ of %s failed: %s", read.mm_hash, error or "ERR")
                if "RemoteDisconnect" in error:
                    self._deliver(read.agent, PeerLost())
            done.append((read.mm_hash, read.key, status == "DONE"))
        return done

    def release(self, transfer_id: str) -> bool:
        """Release the handle of READ `transfer_id` now (NIXL cancels a DMA still running);
        False when it had already ended and was released."""
        read = self.bus.get(EC_READ_HANDLE, transfer_id)
        if read is None or not read.has("in_flight"):
            return False
        self.abandoned += 1
        self._drop(read.ctx, Released())
        return True

    def _drop(self, read: ReadHandleCtx, event: Completed | Released) -> None:
        """Release a READ's handle (`event` ends its machine); its agent counts one READ
        fewer."""
        try:
            self.agent.release(cast(XferHandle, read.handle))
        except KvHandoffError as exc:
            log.debug("releasing a READ handle: %s", exc)
        self.bus.dispatch(EC_READ_HANDLE, read.key, event, self.clock())
        self._deliver(read.agent, ReadEnded())

    # -- agents (the effects of their machines) ------------------------------------------

    def peer_lost(self, host: str, port: int) -> None:
        """The control plane lost the producer at `host:port`: forget its agents (B-08)."""
        for inst in self.bus.instances(EC_PRODUCER_AGENT):
            ctx = inst.ctx
            if (ctx.peer_host, ctx.peer_port) == (host, port):
                self._deliver(ctx.key, PeerLost())

    def _fail_reads(self, inst: Instance[Any] | None, effect: FailReads) -> None:
        """READs of a replaced agent cannot complete: release them, report them failed."""
        for read in self.bus.tagged(EC_READ_HANDLE, "in_flight"):
            if read.ctx.agent == effect.name:
                with contextlib.suppress(KvHandoffError):
                    self.agent.release(cast(XferHandle, read.ctx.handle))
                self.bus.dispatch(EC_READ_HANDLE, read.key, AgentReplaced(), self.bus.now)

    def _forget_agent(self, inst: Instance[Any] | None, effect: ForgetAgent) -> None:
        if effect.name not in self.agent.remotes:
            return
        try:
            self.agent.remove_remote(effect.name)  # releases its prepared lists too
        except KvHandoffError as exc:
            log.debug("forgetting agent %s: %s", effect.name, exc)
        self.agents_forgotten += 1

    # -- facts and teardown ----------------------------------------------------------------

    def in_flight(self) -> int:
        return len(self.bus.tagged(EC_READ_HANDLE, "in_flight"))

    def loaded_agents(self) -> dict[str, bytes]:
        """Producer agents loaded now: name -> the metadata they were loaded from."""
        return {inst.ctx.key: inst.ctx.metadata for inst in self.bus.instances(EC_PRODUCER_AGENT)}

    def close(self) -> None:
        """Release every READ handle and forget every agent (the NIXL agent itself
        belongs to the caller)."""
        now = self.clock()
        for read in self.bus.tagged(EC_READ_HANDLE, "in_flight"):
            with contextlib.suppress(KvHandoffError):
                self.agent.release(cast(XferHandle, read.ctx.handle))
            self.bus.dispatch(EC_READ_HANDLE, read.key, Released(), now)
        for inst in self.bus.instances(EC_PRODUCER_AGENT):
            self._deliver(inst.ctx.key, Close())
