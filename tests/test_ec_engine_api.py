"""The encoder-cache tier offers vLLM 0.33's `ECConnectorBase` call names and signatures
(R-T01): scheduler-side calls on `ECSide`, worker-side calls on `ECWorkerSide`.

The parameter lists below are pinned from vLLM 0.33.0's
`vllm/distributed/ec_transfer/ec_connector/base.py`; when the slim vLLM environment
exists, the pin is checked against that file's source (read with `ast`, not imported).
"""

from __future__ import annotations

import ast
import glob
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch
from test_ec_api import NOW, alloc, local, request, run_step

from kvhandoff.adapters.ec_side import ECSide
from kvhandoff.adapters.ec_worker_side import ECWorkerSide
from kvhandoff.adapters.shm.region import SharedRegion
from kvhandoff.machines.ec.nixl_gate import NIXL_MISSING_MESSAGE
from kvhandoff.machines.ec.scheduler import ECScheduler
from kvhandoff.protocol.errors import LocalProtocolError
from kvhandoff.sim.ec.engine import COMPAT, layout, transfer_config

SCHEDULER_CALLS = {
    "has_cache_item": ["identifier"],
    "ensure_cache_available": ["request", "num_computed_tokens"],
    "update_state_after_alloc": ["request", "index"],
    "update_state_after_free": ["request", "index"],
    "take_unavailable_requests": [],
    "build_connector_meta": ["scheduler_output"],
    "update_connector_output": ["connector_output"],
    "request_finished": ["request"],
    "has_pending_push_work": [],
}
WORKER_CALLS = {
    "bind_connector_metadata": ["connector_metadata"],
    "clear_connector_metadata": [],
    "start_load_caches": ["encoder_cache", "**kwargs"],
    "save_caches": ["encoder_cache", "mm_hash", "**kwargs"],
    "get_finished": ["finished_req_ids"],
    "build_connector_worker_meta": [],
    "shutdown": [],
}
VLLM_BASE = "ec_transfer/ec_connector/base.py"


def params(fn: object) -> list[str]:
    out = []
    for p in list(inspect.signature(fn).parameters.values())[1:]:  # type: ignore[arg-type]
        out.append(f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name)
    return out


@pytest.mark.parametrize(
    ("cls", "calls"), [(ECSide, SCHEDULER_CALLS), (ECWorkerSide, WORKER_CALLS)]
)
def test_R_T01_sides_offer_the_ec_connector_base_calls(
    cls: type, calls: dict[str, list[str]]
) -> None:
    for name, expected in calls.items():
        assert params(getattr(cls, name)) == expected, name


def vllm_base_source() -> str | None:
    root = Path(__file__).resolve().parents[1]
    pattern = str(root / ".venv-vllm/lib/python3.*/site-packages/vllm/distributed" / VLLM_BASE)
    found = sorted(glob.glob(pattern))
    return Path(found[-1]).read_text() if found else None


def test_R_T01_the_pinned_calls_are_vllms() -> None:
    source = vllm_base_source()
    if source is None:
        pytest.skip("no .venv-vllm (make vllm-env): the pin stays as recorded")
    tree = ast.parse(source)
    base = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ECConnectorBase")
    found: dict[str, list[str]] = {}
    for node in base.body:
        if isinstance(node, ast.FunctionDef):
            names = [a.arg for a in node.args.args[1:]]
            if node.args.kwarg is not None:
                names.append(f"**{node.args.kwarg.arg}")
            found[node.name] = names
    for name, expected in {**SCHEDULER_CALLS, **WORKER_CALLS}.items():
        assert found[name] == expected, name


def test_R_E02_without_nixl_the_side_raises_the_seeds_error_before_touching_shm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = importlib.util.find_spec

    def no_nixl(name: str, *args: Any) -> Any:
        return None if name.startswith("nixl") else real(name, *args)

    stale = tmp_path / "kvhandoff_ec_gone_dp0.mmap"  # a dead owner's region: no holder
    stale.write_bytes(b"\0" * 64)
    monkeypatch.setattr(importlib.util, "find_spec", no_nixl)
    config = transfer_config("ec_both", 8, engine_id="no-nixl")
    with pytest.raises(RuntimeError) as info:
        ECSide(
            config, layout(8), compat_hash=COMPAT, shm_dir=str(tmp_path), listen=("127.0.0.1", 0)
        )
    assert str(info.value) == NIXL_MISSING_MESSAGE
    assert sorted(p.name for p in tmp_path.iterdir()) == [stale.name]  # nothing reaped or made


def test_R_T01_ranks_beyond_one_need_worker_sides() -> None:
    config = transfer_config("ec_consumer", 8, engine_id="tp2")
    with pytest.raises(LocalProtocolError, match="ECWorkerSide"):
        ECSide(config, layout(8), compat_hash=COMPAT, tp_size=2)


def test_R_E04_after_shutdown_nothing_is_cached_and_calls_fail_clearly() -> None:
    scheduler, worker = local("ec_both")
    alloc(scheduler, "r1", "h", 3)
    run_step(scheduler, worker)
    assert scheduler.has_cache_item("h")
    scheduler.shutdown()
    scheduler.shutdown()  # idempotent
    assert not scheduler.has_cache_item("h")
    calls = [
        lambda: scheduler.ensure_cache_available(request("r2", "h"), 0, NOW),
        lambda: scheduler.update_state_after_alloc(request("r2", "h"), 0, NOW),
        lambda: scheduler.build_connector_meta(NOW),
        lambda: scheduler.update_connector_output(None, NOW),
        lambda: scheduler.request_finished(request("r2", "h"), NOW),
        lambda: scheduler.poll(NOW),
    ]
    for call in calls:
        with pytest.raises(LocalProtocolError, match="shut down"):
            call()


def test_R_T06_worker_sides_save_on_the_writer_and_load_on_every_rank(tmp_path: Path) -> None:
    """Local tier, TP=2: the scheduler half and two `ECWorkerSide`s on one region."""
    config = transfer_config("ec_both", 8, engine_id="ws", p2p=False)
    lay = layout(8)
    scheduler = ECScheduler(config, lay, tp_size=2)
    with SharedRegion.create("kvhandoff_ec_ws_dp0.mmap", lay.region_bytes, shm_dir=str(tmp_path)):
        ranks = [
            ECWorkerSide(
                config,
                lay,
                region_name="kvhandoff_ec_ws_dp0.mmap",
                tp_rank=rank,
                shm_dir=str(tmp_path),
            )
            for rank in range(2)
        ]
        caches: list[dict[str, torch.Tensor]] = [{}, {}]
        output = torch.arange(3 * lay.hidden_dim, dtype=torch.bfloat16).view(3, lay.hidden_dim)

        def step(save: str | None = None) -> None:
            meta = scheduler.build_connector_meta(NOW)
            outs = []
            for side, cache in zip(ranks, caches, strict=True):
                side.bind_connector_metadata(meta)
                side.start_load_caches(cache)
                if save is not None:
                    cache[save] = output.clone()
                    side.save_caches(cache, save)
                outs.append(side.build_connector_worker_meta())
                side.clear_connector_metadata()
            assert outs[1] is None or not outs[1].reports[0].saved, "rank 1 never writes"
            for out in outs:
                scheduler.update_connector_output(out, NOW)

        alloc(scheduler, "r1", "h", 3)
        step(save="h")
        assert scheduler.has_cache_item("h")
        for cache in caches:
            cache.clear()
        assert scheduler.ensure_cache_available(request("r2", "h", tokens=3), 0, NOW)
        alloc(scheduler, "r2", "h", 3)
        step()
        for cache in caches:
            assert torch.equal(cache["h"].view(torch.uint8), output.view(torch.uint8))
        assert scheduler.cache.has("h", "loadable")
        for side in ranks:
            side.shutdown()
            side.shutdown()  # idempotent
        with pytest.raises(LocalProtocolError, match="shut down"):
            ranks[0].start_load_caches({})
