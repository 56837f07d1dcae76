"""A typed wrapper around one real NIXL agent.

`NixlAgent` owns a `nixl_agent`, registers memory, loads and forgets remote agents,
prepares block descriptor lists once per layout, and posts WRITE/READ transfers by
descriptor index. Every exception NIXL raises leaves this module as one type,
`NixlTransferError(op, detail)`; misuse by the caller (a closed agent, a handle of the
wrong side, index lists of different lengths) is a `LocalProtocolError`.

The NIXL backend is a constructor argument, UCX by default (B-03). The agent is created
with a thread-synchronisation mode (STRICT by default) because the push writer thread and
the main thread (heartbeats) both call into it.

The descriptor numbering is `layout.BlockLayout` (see there); the records handed out are
in `handles`, the error type in `errors`; this module re-exports them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kvhandoff.adapters.nixl.errors import NixlTransferError, describe
from kvhandoff.adapters.nixl.handles import (
    MemKind,
    PreppedBlocks,
    Registration,
    ThreadSync,
    XferHandle,
    XferState,
)
from kvhandoff.adapters.nixl.layout import BlockLayout, BlockRegion, IndexList
from kvhandoff.adapters.nixl.loader import load_nixl
from kvhandoff.protocol.errors import LocalProtocolError

if TYPE_CHECKING:
    import torch

__all__ = [
    "BlockLayout",
    "BlockRegion",
    "IndexList",
    "MemKind",
    "NixlAgent",
    "NixlTransferError",
    "PreppedBlocks",
    "Registration",
    "ThreadSync",
    "XferHandle",
    "XferState",
]

_LOCAL_SIDE = "NIXL_INIT_AGENT"


class NixlAgent:
    """One NIXL agent with one backend (UCX by default, B-03)."""

    def __init__(
        self,
        name: str,
        backend: str = "UCX",
        *,
        backend_params: Mapping[str, str] | None = None,
        thread_sync: ThreadSync = "STRICT",
        progress_thread: bool = True,
        nixl_module: ModuleType | None = None,
    ) -> None:
        if not name:
            raise LocalProtocolError("a NIXL agent needs a non-empty name")
        mod = nixl_module if nixl_module is not None else load_nixl()
        self.name = name
        self.backend = backend
        self._registrations: list[Registration] = []
        self._prepped: list[PreppedBlocks] = []
        self._remotes: set[str] = set()
        self._closed = False
        try:
            sync = mod.nixl_thread_sync_t[f"NIXL_THREAD_SYNC_{thread_sync}"]
            config = mod.nixl_agent_config(
                enable_prog_thread=progress_thread, backends=[], sync_mode=sync
            )
            self._agent: Any = mod.nixl_agent(name, config)
        except Exception as exc:
            raise NixlTransferError("create_agent", describe(exc)) from exc
        plugins = list(self._agent.get_plugin_list())
        if backend not in plugins:
            raise NixlTransferError(
                "create_backend", f"no NIXL plugin named {backend!r}; available: {plugins}"
            )
        try:
            self._agent.create_backend(backend, dict(backend_params or {}))
        except Exception as exc:
            raise NixlTransferError("create_backend", f"{backend}: {describe(exc)}") from exc

    # -- lifecycle ---------------------------------------------------------------------

    def _live(self) -> Any:
        """The underlying agent; a `LocalProtocolError` once closed."""
        if self._closed:
            raise LocalProtocolError(f"NIXL agent {self.name!r} is closed")
        return self._agent

    def close(self) -> None:
        """Release prepared lists, deregister memory and forget remotes. Idempotent."""
        if self._closed:
            return
        agent = self._agent
        for prepped in self._prepped:
            with contextlib.suppress(NixlTransferError):
                self._release_prepped(prepped)
        self._prepped.clear()
        for reg in self._registrations:
            if reg.active:
                reg.active = False
                with contextlib.suppress(Exception):  # best effort: the agent goes anyway
                    agent.deregister_memory(reg.raw)
        self._registrations.clear()
        for remote in sorted(self._remotes):
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(remote)
        self._remotes.clear()
        self._closed = True
        self._agent = None

    def __enter__(self) -> NixlAgent:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- memory ------------------------------------------------------------------------

    def register_dram(self, addr: int, size: int) -> Registration:
        """Register `size` bytes of host memory at `addr`."""
        return self._register(addr, size, "DRAM", 0)

    def register_vram(self, addr: int, size: int, device_id: int = 0) -> Registration:
        """Register `size` bytes of GPU memory at device address `addr` on `device_id`."""
        return self._register(addr, size, "VRAM", device_id)

    def register_tensor(self, tensor: torch.Tensor) -> Registration:
        """Register a contiguous tensor: DRAM for a CPU tensor, VRAM for a CUDA one."""
        if not tensor.is_contiguous():
            raise LocalProtocolError("only contiguous tensors can be registered")
        kind = tensor.device.type
        if kind == "cpu":
            mem: MemKind = "DRAM"
            device_id = 0
        elif kind == "cuda":
            mem = "VRAM"
            device_id = tensor.get_device()
        else:
            raise LocalProtocolError(f"cannot register a tensor on device {tensor.device}")
        size = tensor.numel() * tensor.element_size()
        return self._register(tensor.data_ptr(), size, mem, device_id)

    def _register(self, addr: int, size: int, mem: MemKind, device_id: int) -> Registration:
        if addr <= 0 or size <= 0:
            raise LocalProtocolError(f"cannot register addr={addr:#x} size={size}")
        agent = self._live()
        try:
            raw = agent.register_memory([(addr, size, device_id, "")], mem)
        except Exception as exc:
            raise NixlTransferError("register_memory", describe(exc)) from exc
        reg = Registration(addr=addr, size=size, mem=mem, raw=raw)
        self._registrations.append(reg)
        return reg

    def deregister(self, reg: Registration) -> None:
        """Deregister memory registered by this agent. Idempotent."""
        if not reg.active:
            return
        agent = self._live()
        reg.active = False
        if reg in self._registrations:
            self._registrations.remove(reg)
        try:
            agent.deregister_memory(reg.raw)
        except Exception as exc:
            raise NixlTransferError("deregister_memory", describe(exc)) from exc

    # -- metadata and remotes ----------------------------------------------------------

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registrations) for a peer."""
        try:
            return bytes(self._live().get_agent_metadata())
        except LocalProtocolError:
            raise
        except Exception as exc:
            raise NixlTransferError("metadata", describe(exc)) from exc

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name."""
        agent = self._live()
        try:
            raw_name = agent.add_remote_agent(bytes(metadata))
        except Exception as exc:
            raise NixlTransferError("add_remote", describe(exc)) from exc
        name = raw_name.decode() if isinstance(raw_name, bytes) else str(raw_name)
        self._remotes.add(name)
        return name

    def remove_remote(self, name: str) -> None:
        """Forget a peer (and release its prepared lists, which NIXL voids anyway)."""
        agent = self._live()
        for prepped in [p for p in self._prepped if p.agent_name == name]:
            self._release_prepped(prepped)
            self._prepped.remove(prepped)
        self._remotes.discard(name)
        try:
            agent.remove_remote_agent(name)
        except Exception as exc:
            raise NixlTransferError("remove_remote", f"{name}: {describe(exc)}") from exc

    @property
    def remotes(self) -> frozenset[str]:
        """Names of the peers whose metadata is loaded."""
        return frozenset(self._remotes)

    # -- prepared descriptor lists ----------------------------------------------------

    def prep_local_blocks(
        self, regions: Iterable[tuple[int, int, int]], mem: MemKind = "DRAM", device_id: int = 0
    ) -> PreppedBlocks:
        """Prepare this agent's block descriptors once per layout."""
        return self._prep("", BlockLayout(regions), mem, device_id)

    def prep_remote_blocks(
        self,
        remote_name: str,
        regions: Iterable[tuple[int, int, int]],
        mem: MemKind = "DRAM",
        device_id: int = 0,
    ) -> PreppedBlocks:
        """Prepare a peer's block descriptors (addresses from its handshake) once per layout."""
        if not remote_name:
            raise LocalProtocolError("a remote descriptor list needs the peer's agent name")
        return self._prep(remote_name, BlockLayout(regions), mem, device_id)

    def _prep(self, agent_name: str, layout: BlockLayout, mem: MemKind, dev: int) -> PreppedBlocks:
        agent = self._live()
        op = "prep_local_blocks" if agent_name == "" else "prep_remote_blocks"
        try:
            raw = agent.prep_xfer_dlist(agent_name or _LOCAL_SIDE, layout.descriptor_rows(dev), mem)
        except Exception as exc:
            raise NixlTransferError(op, f"{agent_name or 'local'}: {describe(exc)}") from exc
        prepped = PreppedBlocks(agent_name=agent_name, mem=mem, layout=layout, raw=raw)
        self._prepped.append(prepped)
        return prepped

    def release_blocks(self, prepped: PreppedBlocks) -> None:
        """Release a prepared list (for a layout that is gone). Idempotent."""
        self._release_prepped(prepped)
        if prepped in self._prepped:
            self._prepped.remove(prepped)

    @staticmethod
    def _release_prepped(prepped: PreppedBlocks) -> None:
        if prepped.released:
            return
        prepped.released = True
        try:
            prepped.raw.release()
        except Exception as exc:
            raise NixlTransferError("release_blocks", describe(exc)) from exc

    # -- transfers ---------------------------------------------------------------------

    def write(
        self,
        local: PreppedBlocks,
        local_indices: IndexList,
        remote: PreppedBlocks,
        remote_indices: IndexList,
        notif: bytes = b"",
    ) -> XferHandle:
        """Post a WRITE of local descriptors into the peer's; `notif` reaches the peer after."""
        return self._post("WRITE", local, local_indices, remote, remote_indices, notif)

    def read(
        self,
        local: PreppedBlocks,
        local_indices: IndexList,
        remote: PreppedBlocks,
        remote_indices: IndexList,
        notif: bytes = b"",
    ) -> XferHandle:
        """Post a READ of the peer's descriptors into local ones."""
        return self._post("READ", local, local_indices, remote, remote_indices, notif)

    def _post(
        self,
        op: Literal["WRITE", "READ"],
        local: PreppedBlocks,
        local_indices: IndexList,
        remote: PreppedBlocks,
        remote_indices: IndexList,
        notif: bytes,
    ) -> XferHandle:
        agent = self._live()
        if not local.is_local or remote.is_local:
            raise LocalProtocolError(f"{op} needs a local list then a remote list")
        lidx = np.ascontiguousarray(local_indices, dtype=np.int32).reshape(-1)
        ridx = np.ascontiguousarray(remote_indices, dtype=np.int32).reshape(-1)
        if lidx.size != ridx.size or lidx.size == 0:
            raise LocalProtocolError(
                f"{op} needs equal, non-empty index lists (got {lidx.size} and {ridx.size})"
            )
        for side, idx in ((local, lidx), (remote, ridx)):
            # One reduction per side: a negative int32 read as uint32 is at least 2**31.
            if int(idx.view(np.uint32).max()) >= side.layout.num_descs:
                raise LocalProtocolError(
                    f"{op} index out of range 0..{side.layout.num_descs - 1} "
                    f"for {side.agent_name or 'local'} descriptors"
                )
        name = op.lower()
        if local.released or remote.released:
            raise NixlTransferError(name, "descriptor list released (peer removed?)")
        try:
            raw = agent.make_prepped_xfer(op, local.raw, lidx, remote.raw, ridx, notif)
        except Exception as exc:
            raise NixlTransferError(name, f"{remote.agent_name}: {describe(exc)}") from exc
        handle = XferHandle(op=op, remote=remote.agent_name, notif=notif, raw=raw)
        try:
            status = agent.transfer(raw)
        except Exception as exc:
            self._release_quietly(handle)
            raise NixlTransferError(name, f"{remote.agent_name}: {describe(exc)}") from exc
        if status == "ERR":
            self._release_quietly(handle)
            raise NixlTransferError(name, f"{remote.agent_name}: post returned ERR")
        handle.xfer_status = "DONE" if status == "DONE" else "PROC"
        return handle

    def poll(self, handle: XferHandle) -> XferState:
        """Current status of a transfer: "DONE", "PROC" or "ERR" (terminal ones stick).

        A NIXL exception while checking (for instance a disconnected peer) counts as
        "ERR" rather than raising, so one poll loop sees every outcome in one place; its
        text is kept in `handle.error`.
        """
        if handle.xfer_status != "PROC" or handle.released:
            return handle.xfer_status
        agent = self._live()
        try:
            status = agent.check_xfer_state(handle.raw)
        except Exception as exc:
            status = "ERR"
            handle.error = describe(exc)
        handle.xfer_status = "DONE" if status == "DONE" else "ERR" if status == "ERR" else "PROC"
        return handle.xfer_status

    def release(self, handle: XferHandle) -> None:
        """Free a transfer handle (NIXL tries to cancel one still in flight). Idempotent."""
        if handle.released:
            return
        self._live()
        try:
            handle.raw.release()
        except Exception as exc:
            raise NixlTransferError("release", describe(exc)) from exc
        handle.released = True

    @staticmethod
    def _release_quietly(handle: XferHandle) -> None:
        handle.xfer_status = "ERR"
        try:
            handle.raw.release()
            handle.released = True
        except Exception:  # NIXL keeps a leaked handle for the agent's destructor
            pass

    # -- notifications -----------------------------------------------------------------

    def send_notif(self, remote_name: str, msg: bytes) -> None:
        """Send a notification message to a loaded peer."""
        agent = self._live()
        try:
            agent.send_notif(remote_name, bytes(msg))
        except Exception as exc:
            raise NixlTransferError("send_notif", f"{remote_name}: {describe(exc)}") from exc

    def get_new_notifs(self) -> list[tuple[str, bytes]]:
        """Notifications that arrived since the last call, as `(sender, message)` pairs.

        Messages are in arrival order, which is not the posting order: the notifs of
        concurrent transfers from one peer can arrive in any order.
        """
        agent = self._live()
        try:
            by_sender = agent.get_new_notifs()
        except Exception as exc:
            raise NixlTransferError("get_new_notifs", describe(exc)) from exc
        return [
            (sender if isinstance(sender, str) else bytes(sender).decode(), bytes(msg))
            for sender, msgs in by_sender.items()
            for msg in msgs
        ]
