"""Which path a CUDA IPC peer gets and why (issue 29, B-12 across the GPUs of one host):
pure selection logic, CPU only."""

from __future__ import annotations

import pytest

from kvhandoff.adapters.cuda.ipc_route import COPY_ENGINE_MIN_BLOCK, choose_route, coalesce

SMALL = 32 * 1024  # vLLM's layer layout: 32 KiB blocks


def test_B_12_same_device_takes_the_one_gpu_kernel() -> None:
    choice = choose_route(0, 0, True, SMALL)
    assert (choice.route, choice.ipc) == ("same_device", True)
    # Peer access is irrelevant on one GPU, and no cross-device preference changes it.
    assert choose_route(3, 3, False, SMALL, "copy_engine").route == "same_device"


def test_B_12_peer_access_takes_the_kernel_for_small_blocks() -> None:
    choice = choose_route(0, 1, True, SMALL)
    assert choice.route == "peer_kernel"
    assert "GPU 0 -> GPU 1" in choice.reason


def test_B_12_peer_access_takes_the_copy_engine_for_large_blocks() -> None:
    assert choose_route(0, 1, True, COPY_ENGINE_MIN_BLOCK).route == "copy_engine"
    assert choose_route(0, 1, True, COPY_ENGINE_MIN_BLOCK - 16).route == "peer_kernel"


def test_B_12_an_explicit_cross_device_choice_wins_over_auto() -> None:
    assert choose_route(0, 1, True, SMALL, "copy_engine").route == "copy_engine"
    assert choose_route(0, 1, True, COPY_ENGINE_MIN_BLOCK, "kernel").route == "peer_kernel"


def test_B_12_no_peer_access_falls_back_to_nixl() -> None:
    choice = choose_route(0, 1, False, SMALL, "copy_engine")
    assert (choice.route, choice.ipc) == ("nixl", False)
    assert "cudaDeviceCanAccessPeer" in choice.reason


def test_B_12_an_invisible_peer_gpu_falls_back_to_nixl() -> None:
    choice = choose_route(0, None, False, SMALL)
    assert choice.route == "nixl"
    assert "not visible" in choice.reason


def test_B_12_an_unknown_cross_device_choice_is_refused() -> None:
    with pytest.raises(ValueError, match="cross_device"):
        choose_route(0, 1, True, SMALL, "dma")  # type: ignore[arg-type]


def test_B_12_copy_engine_runs_merge_blocks_adjacent_on_both_sides() -> None:
    assert coalesce([0, 1, 2, 7, 8], [5, 6, 7, 1, 2]) == [(0, 5, 3), (7, 1, 2)]
    # Adjacent on one side only: separate DMAs.
    assert coalesce([0, 1], [4, 9]) == [(0, 4, 1), (1, 9, 1)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError):
        coalesce([0, 1], [0])
