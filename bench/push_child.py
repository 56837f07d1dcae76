"""`kvhandoff bench push`: the child process of each side.

`python -m kvhandoff.bench.push_child ROLE CONFIG_JSON [PREFILL_PORT]` starts P or D and
runs the parent's commands from stdin, one JSON object a line: P prepares, pushes, and
posts the raw baseline and diagnostic WRITEs; D arms, receives and verifies. Between
commands the side keeps stepping its connector like an idle engine.
"""

from __future__ import annotations

import json
import os
import select
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvhandoff.bench.push_kv import (
    BASELINE_NOTIF,
    RAW_NOTIF,
    PushBenchConfig,
    baseline_pattern,
    request_blocks,
)
from kvhandoff.bench.push_node import BenchSide, emit

if TYPE_CHECKING:
    from kvhandoff.bench.push_peer import PeerCopy


class BenchPrefill(BenchSide):
    def __init__(self, cfg: PushBenchConfig, role: str) -> None:
        super().__init__(cfg, role)
        # When each WRITE left the writer thread: the phases of a rep, for the report.
        self.posted: list[float] = []
        self._peer_copy: PeerCopy | None = None
        write_blocks = self.transport.write_blocks

        def timed_write_blocks(*args: Any, **kwargs: Any) -> Any:
            handle = write_blocks(*args, **kwargs)
            self.posted.append(time.monotonic())
            return handle

        self.transport.write_blocks = timed_write_blocks  # type: ignore[method-assign]

    def prepare(self, rep: int) -> None:
        self.kv.fill(rep)
        self.sync()
        emit("prepared", rep=rep)

    def await_registrations(self, rep: int) -> None:
        """Step like an idle engine until P's writer holds a PUSH_REG for every request
        of the rep (each D rank's registration is held in its match slot until P's
        blocks arrive), or the rep's deadline passes; the wait is not timed."""
        wanted = self.cfg.requests * len(self.side.ranks)
        deadline = self.deadline()
        while self._held() < wanted and time.monotonic() < deadline:
            self.step()
            self.idle()
        emit("registrations_held", rep=rep, held=self._held())

    def _held(self) -> int:
        # The writer thread's count of held registrations (an int, read without a lock).
        return sum(rank.writer.pending_count for rank in self.side.ranks)

    def go(self, rep: int) -> None:
        side = self.side
        todo = [(self.request_id(rep, q), blocks) for q, blocks in enumerate(self.kv.blocks)]
        pending = {rid for rid, _ in todo}
        per_step = self.cfg.finish_per_step or len(todo)
        deadline = self.deadline()
        self.posted.clear()
        t_step = 0.0
        t_first = time.monotonic()
        t_finished: list[float] = []
        while pending and time.monotonic() < deadline:
            for rid, blocks in todo[:per_step]:
                t_finished.append(time.monotonic())
                side.request_finished(rid, blocks, {"do_remote_decode": True})
            todo = todo[per_step:]
            output = self.step()
            t_step = t_step or time.monotonic()
            pending -= output.finished_sending
            if pending:
                self.idle()
        if pending:  # what every thread was doing when the rep ran out of time
            import faulthandler

            faulthandler.dump_traceback(sys.stderr, all_threads=True)
        emit(
            "pushed",
            rep=rep,
            t_first=t_first,
            t_sent=time.monotonic(),
            t_step=t_step,
            t_post_first=min(self.posted, default=None),
            t_post_last=max(self.posted, default=None),
            t_finished=t_finished,
            unsent=len(pending),
            **self.counters(),
        )

    def baseline_prepare(self, rep: int, remote_addr: int, nbytes: int) -> None:
        self.stop_writer()
        self.baseline.copy_(baseline_pattern(nbytes // 8, rep, self.device))
        self.sync()
        if self._baseline_descs is None:
            mem = self.nixl.mem
            peer = self.nixl.engine("bench-decode")
            if peer is None:
                raise RuntimeError("the baseline runs after a framework rep connected P to D")
            local = self.agent.prep_local_blocks(
                [(self.baseline.data_ptr(), nbytes, 1)],
                mem,  # type: ignore[arg-type]
            )
            remote = self.agent.prep_remote_blocks(
                peer.agent(0),
                [(remote_addr, nbytes, 1)],
                mem,  # type: ignore[arg-type]
                self.cfg.peer_device,  # D's buffer lives on D's GPU
            )
            self._baseline_descs = (local, remote)
        emit("baseline_prepared", rep=rep)

    def baseline_go(self, rep: int) -> None:
        assert self._baseline_descs is not None
        local, remote = self._baseline_descs
        agent = self.agent
        deadline = self.deadline()
        t0 = time.monotonic()
        handle = agent.write(local, [0], remote, [0], f"{BASELINE_NOTIF}{rep}".encode())
        while agent.poll(handle) == "PROC" and time.monotonic() < deadline:
            pass
        t_done = time.monotonic()
        agent.release(handle)
        self.start_writer()
        emit("baseline_sent", rep=rep, t0=t0, t_done=t_done, state=handle.xfer_status)

    def peer_copy(self, rep: int) -> None:
        """The raw device-to-device copy of the baseline's bytes to D's GPU (`push_peer`)."""
        if self._peer_copy is None:
            from kvhandoff.bench.push_peer import PeerCopy

            self._peer_copy = PeerCopy(self.baseline, self.cfg.peer_device)
        emit("peer_copied", rep=rep, **self._peer_copy.run(rep, self.cfg.peer_copy_reps))

    def raw_go(self, rep: int, per_request: bool) -> None:
        """Diagnostic, no framework: the framework's block descriptors in raw WRITEs, either
        one WRITE per request (each with a notif) or every request's in a single WRITE."""
        transport = self.nixl
        peer = transport._data("bench-decode", 0)  # the bench looks inside on purpose
        local_list = transport._local[1]
        local_layout, remote_layout = local_list.layout, peer.prepped.layout
        pairs = list(zip(self.kv.blocks, request_blocks(self.cfg, "decode"), strict=True))
        if not per_request:
            pairs = [([b for p, _ in pairs for b in p], [b for _, d in pairs for b in d])]
        self.stop_writer()
        agent = self.agent
        deadline = self.deadline()
        t0 = time.monotonic()
        handles = []
        for q, (local_ids, remote_ids) in enumerate(pairs):
            local_idx = local_layout.indices_for_blocks(local_ids)
            remote_idx = remote_layout.indices_for_blocks(remote_ids, regions=peer.route.regions)
            notif = f"{RAW_NOTIF}{rep}:{q}".encode()
            handles.append(agent.write(local_list, local_idx, peer.prepped, remote_idx, notif))
        states = set()
        for handle in handles:
            while agent.poll(handle) == "PROC" and time.monotonic() < deadline:
                pass
            states.add(handle.xfer_status)
            agent.release(handle)
        t_done = time.monotonic()
        self.start_writer()
        state = states.pop() if len(states) == 1 else "ERR"
        emit("raw_sent", rep=rep, t0=t0, t_done=t_done, state=state, writes=len(handles))


class BenchDecode(BenchSide):
    def __init__(self, cfg: PushBenchConfig, role: str, prefill_port: int) -> None:
        super().__init__(cfg, role)
        self.prefill_port = prefill_port
        # When D's writer first saw notifs after arming: the phases of a rep, for the report.
        self.t_notif_first: float | None = None
        self.watch_notifs = False
        get_new_notifs = self.transport.get_new_notifs

        def timed_get_new_notifs() -> list[tuple[str, bytes]]:
            notifs = get_new_notifs()
            if notifs and self.watch_notifs and self.t_notif_first is None:
                self.t_notif_first = time.monotonic()
            return notifs

        self.transport.get_new_notifs = timed_get_new_notifs  # type: ignore[method-assign]

    def arm(self, rep: int) -> None:
        from kvhandoff.machines.push.d_registration import D_REGISTRATION
        from kvhandoff.protocol.legs import PrefillCoordinates, decode_leg

        side = self.side
        self.kv.poison()
        self.sync()
        prefill = PrefillCoordinates("bench-prefill", "127.0.0.1", self.prefill_port, 1)
        rids = []
        for q, blocks in enumerate(self.kv.blocks):
            rid = self.request_id(rep, q)
            leg = decode_leg({"request_id": self.client_id(rep, q)}, prefill)
            side.update_state_after_alloc(rid, blocks, leg["kv_transfer_params"])
            rids.append(rid)
        deadline = self.deadline()
        bus = side.ranks[0].bus
        pending = set(rids)
        failed: dict[str, str] = {}
        received_before_armed = 0
        while time.monotonic() < deadline:  # until every PUSH_REG has left
            output = self.step()
            received_before_armed += len(output.finished_recving)
            pending -= output.finished_recving
            failed.update(output.failed_recving)
            pending -= set(output.failed_recving)
            if not any(bus.has_tag(D_REGISTRATION, rid, "reg_unsent") for rid in pending):
                break
            self.idle()
        self.t_notif_first = None
        self.watch_notifs = True
        emit("armed", rep=rep)
        t_last = time.monotonic()
        t_recv_first = None
        t_received: dict[str, float] = {}
        while pending and time.monotonic() < deadline:
            output = self.step()
            if output.finished_recving or output.failed_recving:
                t_last = time.monotonic()
                for rid in output.finished_recving:
                    t_received.setdefault(rid, t_last)
                t_recv_first = t_recv_first or t_last
                pending -= output.finished_recving
                failed.update(output.failed_recving)
                pending -= set(output.failed_recving)
            if pending:
                self.idle()
        self.watch_notifs = False
        self.sync()
        verified = not pending and not failed and self.kv.verify(rep)
        emit(
            "received",
            rep=rep,
            t_last=t_last,
            t_recv_first=t_recv_first,
            t_notif_first=self.t_notif_first,
            t_received=[t_received.get(rid) for rid in rids],
            unresolved=len(pending),
            failed=len(failed),
            early=received_before_armed,
            verified=verified,
            reasons=sorted(set(failed.values()))[:3],
            **self.counters(),
        )

    def baseline_arm(self, rep: int, nbytes: int) -> None:
        self.stop_writer()  # this loop is the only consumer of notifs until it is done
        self.baseline.fill_(-1)
        self.sync()
        emit("baseline_armed", rep=rep)
        t_end = self._wait_notif(f"{BASELINE_NOTIF}{rep}".encode())
        self.sync()
        pattern = baseline_pattern(nbytes // 8, rep, self.device)
        verified = t_end is not None and bool(
            self.torch.equal(self.baseline[: nbytes // 8], pattern)
        )
        self.start_writer()
        emit("baseline_received", rep=rep, t_end=t_end, verified=verified)

    def raw_arm(self, rep: int, writes: int) -> None:
        """Diagnostic: wait for P's raw WRITEs of the framework's blocks, then check the KV."""
        self.stop_writer()
        self.kv.poison()
        self.sync()
        emit("raw_armed", rep=rep)
        t_end = self._wait_notifs({f"{RAW_NOTIF}{rep}:{q}".encode() for q in range(writes)})
        self.sync()
        verified = t_end is not None and self.kv.verify(rep)
        self.start_writer()
        emit("raw_received", rep=rep, t_end=t_end, verified=verified)

    def _wait_notif(self, want: bytes) -> float | None:
        return self._wait_notifs({want})

    def _wait_notifs(self, want: set[bytes]) -> float | None:
        """Poll NIXL notifs (the writer thread is stopped) until all of `want` arrived."""
        agent = self.agent
        deadline = self.deadline()
        missing = set(want)
        while time.monotonic() < deadline:
            for _peer, message in agent.get_new_notifs():
                missing.discard(message)
            if not missing:
                return time.monotonic()
        return None


IDLE_STEP_S = 0.001


def _commands(side: BenchSide) -> Iterator[dict[str, Any]]:
    """Commands from stdin, one JSON object a line; between them the engine keeps stepping.

    An idle engine still runs its connector every step (here every `IDLE_STEP_S`), so
    its writer consumes what peers send meanwhile (D's PUSH_REGs reach P's writer while P
    "prefills", as in a real deployment).
    """
    fd = sys.stdin.fileno()
    pending = b""
    while True:
        while b"\n" not in pending:
            ready, _, _ = select.select([fd], [], [], IDLE_STEP_S)
            if not ready:
                if side.writer is not None:
                    side.step()
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        if line.strip():
            yield json.loads(line)


def child_main(argv: list[str]) -> int:
    """`python -m kvhandoff.bench.push_child ROLE CONFIG_JSON [PREFILL_PORT]`; commands on stdin."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    role, raw = argv[0], json.loads(argv[1])
    cfg = PushBenchConfig(**raw)
    if cfg.ucx_sgl:
        os.environ["NIXL_UCX_SGL_ENABLE"] = "1"  # read when the UCX backend is created
    side: BenchPrefill | BenchDecode = (
        BenchPrefill(cfg, role) if role == "prefill" else BenchDecode(cfg, role, int(argv[2]))
    )
    device = side.torch.cuda.get_device_name(side.gpu) if cfg.device == "cuda" else "cpu"
    emit(
        "ready",
        port=side.server.port,
        baseline_addr=side.baseline.data_ptr(),
        device=device,
        gpu=side.gpu,
    )
    try:
        for cmd in _commands(side):
            op = cmd.pop("op")
            if op == "quit":
                break
            getattr(side, op)(**cmd)
    except Exception as exc:
        emit("error", detail=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        side.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(child_main(sys.argv[1:]))
