"""The closed-form offloaded iteration time against an explicit segment-by-segment schedule."""
from __future__ import annotations

import pytest

from shared.costmodel import cost_for, load_profile
from shared.model.config import PRESETS
from shared.costmodel.offload import OffloadPart, explicit_schedule, offloaded_iteration_time

C7 = cost_for(PRESETS["llama-7b"], "h100-80gb")
PROFILE = load_profile("h100-80gb")


@pytest.mark.parametrize("link", ["nvlink", "nccl"])
@pytest.mark.parametrize("batch", [(0, 0, 2048), (32, 32 * 1200, 1024), (64, 64 * 1300, 0), (8, 4000, 512)])
@pytest.mark.parametrize("layers", [1, 8, 16, 32])
@pytest.mark.parametrize("mbs", [2, 3])
def test_closed_form_tracks_explicit_schedule(link, batch, layers, mbs):
    b, kv, p = batch
    args = (b, kv, p, p * (p + 1) // 2, p, b + (1 if p else 0))
    parts = [OffloadPart("g", layers, 1.0, PROFILE.link(link), C7)]
    closed = offloaded_iteration_time(C7, parts, [1.0], *args, micro_batches=mbs).total_s
    explicit = explicit_schedule(C7, parts, *args, micro_batches=mbs)
    assert closed == pytest.approx(explicit, rel=0.08)


def test_offload_pays_off_for_prefill_over_nvlink_not_over_slow_links():
    args = (0, 0, 2048, 2048 * 2049 // 2, 2048, 1)
    local = C7.iteration_time(*args)
    fast = offloaded_iteration_time(C7, [OffloadPart("g", 32, 1.0, PROFILE.link("nvlink"), C7)], [1.0], *args)
    slow = offloaded_iteration_time(C7, [OffloadPart("g", 32, 1.0, PROFILE.link("tcp"), C7)], [1.0], *args)
    assert fast.total_s < 0.8 * local
    assert slow.total_s > local  # the driver would run this iteration alone
    assert fast.link_bytes[0] == pytest.approx(2 * 2 * 32 * 1024 * C7.hidden_bytes_per_token)


def test_a_guest_with_little_time_to_give_does_not_help():
    args = (0, 0, 2048, 2048 * 2049 // 2, 2048, 1)
    part = [OffloadPart("g", 32, 0.1, PROFILE.link("nvlink"), C7)]
    assert offloaded_iteration_time(C7, part, [0.1], *args).total_s > C7.iteration_time(*args)
    assert offloaded_iteration_time(C7, part, [1.0], *args).total_s < C7.iteration_time(*args)
