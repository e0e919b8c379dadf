"""Cost model: device profiles, roofline operator/segment/iteration time, transfers, online correction.

Public API::

    load_profile(kind) -> DeviceProfile             # shipped profile of a device kind
    ModelCost(model_config, profile)                # .iteration_time(...), .decode_line(n), .mlp_time(t) ...
    op_time(profile, operator, tokens, kv_tokens)   # one operator
    transfer_time(profile, link_kind, nbytes)       # latency + bytes / bandwidth
    CorrectionTable()                               # EWMA of measured / predicted per (device, kind)
    cost_for(model_config, device_kind)             # cached ModelCost
"""
from __future__ import annotations

from functools import lru_cache

from shared.costmodel.correction import CorrectionTable
from shared.costmodel.model_cost import ModelCost, op_time
from shared.costmodel.profiles import DeviceProfile, LinkSpec, load_profile, load_profile_file, parse_profile
from shared.costmodel.transfer import link_bandwidth, transfer_time
from shared.model.config import ModelConfig


@lru_cache(maxsize=None)
def cost_for(config: ModelConfig, device_kind: str) -> ModelCost:
    """A shared, cached :class:`ModelCost` for a model shape on a device kind (uncorrected)."""
    return ModelCost(config, load_profile(device_kind))


__all__ = ["CorrectionTable", "DeviceProfile", "LinkSpec", "ModelCost", "cost_for", "link_bandwidth",
           "load_profile", "load_profile_file", "op_time", "parse_profile", "transfer_time"]
