"""The consumer's data plane of the encoder-cache P2P tier: NIXL READs of producers'
regions into ours (R-E07, R-E11, B-08).

`ECNixlReader` executes `IssueRead` effects with one `NixlAgent` whose registered region
(ours, the READ destination) is prepared once as a block descriptor list. A producer's
agent is loaded from the metadata its `XferAck` carried, when that agent is new or its
metadata changed (a producer restarted under the same engine id): no separate handshake
(R-E11). The producer's region is prepared as descriptors too; the grant does not say
how large that region is, so the prepared list grows to cover the highest granted block.

`poll()` reports each READ once, `(mm_hash, transfer_id, ok)`. A READ whose reader no
longer waits for it (its quarantine ended) is released, which asks NIXL to cancel it. An
agent whose peer went away (the control plane lost it, or NIXL said the remote
disconnected) is forgotten as soon as no READ uses it, so nothing keeps using a dead
agent (B-08); the next grant brings its metadata again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from kvhandoff.adapters.nixl.agent import NixlAgent, NixlTransferError, PreppedBlocks, XferHandle
from kvhandoff.machines.ec.consumer_read import IssueRead
from kvhandoff.protocol.errors import KvHandoffError, LocalProtocolError, RemoteProtocolError

__all__ = ["ECNixlReader", "ReadCompletion"]

log = logging.getLogger("kvhandoff.ec.nixl_reader")

ReadCompletion = tuple[str, str, bool]
"""`(mm_hash, transfer_id, ok)` of a READ that ended."""


@dataclass(eq=False, slots=True)
class _Remote:
    """A producer agent loaded from the metadata of an `XferAck`."""

    name: str
    metadata: bytes
    peer: tuple[str, int]
    lists: dict[tuple[int, int], PreppedBlocks] = field(default_factory=dict)
    reads: int = 0
    stale: bool = False


@dataclass(eq=False, slots=True)
class _Read:
    mm_hash: str
    handle: XferHandle
    remote: _Remote


class ECNixlReader:
    """NIXL READs from producers' regions into the `num_blocks` blocks at `region_addr`."""

    def __init__(
        self, agent: NixlAgent, region_addr: int, block_size_bytes: int, num_blocks: int
    ) -> None:
        self.agent = agent
        self.block_size_bytes = block_size_bytes
        self.num_blocks = num_blocks
        self._local = agent.prep_local_blocks([(region_addr, block_size_bytes, num_blocks)])
        self._remotes: dict[str, _Remote] = {}
        self._reads: dict[str, _Read] = {}
        self._failed: list[ReadCompletion] = []
        self.agents_loaded = 0
        self.agents_forgotten = 0
        self.post_failures = 0
        self.abandoned = 0

    # -- posting -----------------------------------------------------------------------

    def read(self, effect: IssueRead) -> None:
        """Post the READ of `effect`; a `KvHandoffError` when it cannot be posted."""
        try:
            if effect.block_size_bytes != self.block_size_bytes:
                raise RemoteProtocolError(
                    f"grant of {effect.block_size_bytes}-byte blocks, ours are "
                    f"{self.block_size_bytes}"
                )
            if not effect.src_blocks or len(effect.src_blocks) != len(effect.dst_blocks):
                raise RemoteProtocolError("grant and destination differ in block count")
            if effect.transfer_id in self._reads:
                raise LocalProtocolError(f"READ {effect.transfer_id!r} is already in flight")
            remote = self._remote_for(effect)
            remote_list = self._remote_list(
                remote, effect.remote_base_addr, max(effect.src_blocks) + 1
            )
            handle = self.agent.read(
                self._local, list(effect.dst_blocks), remote_list, list(effect.src_blocks)
            )
        except KvHandoffError as exc:
            self.post_failures += 1
            if isinstance(exc, NixlTransferError) and exc.peer_gone:
                gone = self._remotes.get(effect.producer_agent_name)
                if gone is not None:
                    self._mark_stale(gone)
            raise
        remote.reads += 1
        self._reads[effect.transfer_id] = _Read(effect.mm_hash, handle, remote)

    def _remote_for(self, effect: IssueRead) -> _Remote:
        name, metadata = effect.producer_agent_name, bytes(effect.producer_agent_metadata)
        peer = (effect.peer_host, effect.peer_port)
        remote = self._remotes.get(name)
        if remote is not None and remote.metadata != metadata:
            # The same agent name with new metadata: the producer restarted (R-E11).
            self._forget(remote, failing=True)
            remote = None
        if remote is not None:
            remote.stale = False
            remote.peer = peer
            return remote
        loaded = self.agent.add_remote(metadata)
        if loaded != name:
            with contextlib.suppress(KvHandoffError):
                self.agent.remove_remote(loaded)
            raise RemoteProtocolError(
                f"XferAck names agent {name!r} but carries metadata of {loaded!r}"
            )
        remote = _Remote(name, metadata, peer)
        self._remotes[name] = remote
        self.agents_loaded += 1
        return remote

    def _remote_list(self, remote: _Remote, base: int, needed: int) -> PreppedBlocks:
        """The producer's region as prepared descriptors covering at least `needed`
        blocks: twice the old size when the producer registered that much, else exactly
        `needed`. A list a READ in flight may still use stays until the agent goes."""
        block_len = self.block_size_bytes
        current = remote.lists.get((base, block_len))
        if current is not None and current.layout.num_descs >= needed:
            return current
        grown = 2 * current.layout.num_descs if current is not None else 0
        prepped: PreppedBlocks | None = None
        if grown > needed:
            with contextlib.suppress(NixlTransferError):
                prepped = self.agent.prep_remote_blocks(remote.name, [(base, block_len, grown)])
        if prepped is None:
            prepped = self.agent.prep_remote_blocks(remote.name, [(base, block_len, needed)])
        remote.lists[(base, block_len)] = prepped
        return prepped

    # -- completion ----------------------------------------------------------------------

    def poll(self, awaited: Callable[[str, str], bool]) -> list[ReadCompletion]:
        """READs that ended since the last call. `awaited(mm_hash, transfer_id)` says
        whether someone still waits for a READ; one nobody awaits is cancelled."""
        done, self._failed = self._failed, []
        for transfer_id, read in list(self._reads.items()):
            status = self.agent.poll(read.handle)
            if status == "PROC":
                if not awaited(read.mm_hash, transfer_id):
                    self.abandoned += 1  # its quarantine ended: cancel the DMA
                    self._drop(transfer_id)
                continue
            error = read.handle.error or ""
            self._drop(transfer_id)
            if status != "DONE":
                log.warning("READ of %s failed: %s", read.mm_hash, error or "ERR")
                if "RemoteDisconnect" in error:
                    self._mark_stale(read.remote)
            done.append((read.mm_hash, transfer_id, status == "DONE"))
        return done

    def _drop(self, transfer_id: str) -> None:
        read = self._reads.pop(transfer_id)
        try:
            self.agent.release(read.handle)
        except KvHandoffError as exc:
            log.debug("releasing a READ handle: %s", exc)
        read.remote.reads -= 1
        if read.remote.stale and read.remote.reads == 0:
            self._forget(read.remote)

    # -- agents --------------------------------------------------------------------------

    def peer_lost(self, host: str, port: int) -> None:
        """The control plane lost the producer at `host:port`: forget its agents (B-08)."""
        for remote in list(self._remotes.values()):
            if remote.peer == (host, port):
                self._mark_stale(remote)

    def _mark_stale(self, remote: _Remote) -> None:
        remote.stale = True
        if remote.reads == 0:
            self._forget(remote)

    def _forget(self, remote: _Remote, *, failing: bool = False) -> None:
        if self._remotes.get(remote.name) is remote:
            del self._remotes[remote.name]
        if failing:  # READs of a replaced agent cannot complete: report them failed
            for transfer_id, read in list(self._reads.items()):
                if read.remote is remote:
                    self._drop(transfer_id)
                    self._failed.append((read.mm_hash, transfer_id, False))
        if remote.name not in self.agent.remotes:
            return
        try:
            self.agent.remove_remote(remote.name)  # releases its prepared lists too
        except KvHandoffError as exc:
            log.debug("forgetting agent %s: %s", remote.name, exc)
        self.agents_forgotten += 1

    # -- facts and teardown ----------------------------------------------------------------

    def in_flight(self) -> int:
        return len(self._reads)

    def loaded_agents(self) -> dict[str, bytes]:
        """Producer agents loaded now: name -> the metadata they were loaded from."""
        return {name: remote.metadata for name, remote in self._remotes.items()}

    def close(self) -> None:
        """Release every READ handle (the agent itself belongs to the caller)."""
        for read in self._reads.values():
            with contextlib.suppress(KvHandoffError):
                self.agent.release(read.handle)
        self._reads.clear()
        self._remotes.clear()
