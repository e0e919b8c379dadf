"""The what-if RPC messages round-trip through the codec and decode as their stream's union."""
from __future__ import annotations

from shared.codec import decode, encode
from shared.messages import (DeviceForecast, RequestPrediction, SimReplyMsg, SimRpcMsg, WhatIfCandidate,
                             WhatIfOutcome, WhatIfQuery, WhatIfReply)


def test_whatif_messages_round_trip():
    q = WhatIfQuery(msg_id="m", query_id="q", client="c", deadline_ts=1.5, candidates=[
        WhatIfCandidate(kind="lease", tenant="a", device="g1", home_device="g0", segments=["mlp[0]"], share=0.5,
                        duration_s=0.2, memory_bytes=10),
        WhatIfCandidate(kind="admit", tenant="a", device="g0", input_tokens=5, output_tokens=7, request_id="r")])
    r = WhatIfReply(msg_id="m2", query_id="q", epoch=9, compute_ms=0.3, outcomes=[WhatIfOutcome(
        index=0, feasible=False, memory_ok=False, sla_ok=True, reasons=["memory_now:g1"], gain_ms=1.5,
        requests=[RequestPrediction(["r", "s"], "a", "g0", 12.0, 3.5, True)],
        devices=[DeviceForecast("g1", [(0.0, 0.25)], 100, 200)])])
    assert decode(encode(q), SimRpcMsg) == q
    assert decode(encode(r), SimReplyMsg) == r
