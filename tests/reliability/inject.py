"""Writing straight to the mesh's streams, as a stand-in gateway: requests with a fake gateway id (their results
land on ``tokens:{fake}``, which the tap follows), duplicates and replays, and poison entries of every kind the
matrix names (truncated MessagePack, wrong schema, a 50 MB blob, deep nesting)."""
from __future__ import annotations

import time
import uuid

import msgspec
import redis as syncredis

from shared.codec import encode
from shared.messages import InferenceRequest, requests_stream
from shared.streams import FIELD_MSG, FIELD_TYPE

BOS = 256


def fake_request(tenant: str, gateway: str, *, max_tokens: int = 4, deadline_ts: float = 0.0,
                 prompt: str = "direct") -> InferenceRequest:
    rid = f"inj-{uuid.uuid4().hex}"
    return InferenceRequest(msg_id=rid, request_id=rid, tenant=tenant, gateway=gateway,
                            prompt_ids=[BOS, *prompt.encode()], max_tokens=max_tokens, arrival_ts=time.time(),
                            deadline_ts=deadline_ts, ignore_eos=True)


def xadd_requests(r: syncredis.Redis, prefix: str, reqs: list[InferenceRequest], *, copies: int = 1) -> None:
    """XADD each request ``copies`` times back to back (the same message: a duplicated delivery)."""
    stream = requests_stream(prefix)
    for i in range(0, len(reqs), 500):
        pipe = r.pipeline(transaction=False)
        for q in reqs[i:i + 500]:
            for _ in range(copies):
                pipe.xadd(stream, {FIELD_TYPE: type(q).__name__, FIELD_MSG: encode(q)})
        pipe.execute()


def poison_payloads(gateway: str, *, each: int = 5, big_mb: int = 50) -> dict[str, list[bytes]]:
    """Payloads by kind; wrong-schema ones carry a request id and gateway so the requester can be told."""
    ok = encode(fake_request("tiny-a", gateway))
    out = {"truncated": [ok[: len(ok) // 2 - i] for i in range(each)],
           "wrong_schema": [msgspec.msgpack.encode({"type": "InferenceRequest", "gateway": gateway, "tenant": "tiny-a",
                                                    "request_id": f"poison-{uuid.uuid4().hex}", "prompt_ids": "oops"})
                            for _ in range(each)],
           "deeply_nested": [b"\x91" * 100_000 + b"\xc0" for _ in range(each)],
           "blob_50mb": [b"\xc6" + (big_mb * 2**20).to_bytes(4, "big") + b"x" * (big_mb * 2**20)]}
    return out


def xadd_poison(r: syncredis.Redis, stream: str, payloads: dict[str, list[bytes]]) -> list[str]:
    ids = []
    for kind, items in payloads.items():
        for raw in items:
            ids.append(r.xadd(stream, {FIELD_TYPE: kind, FIELD_MSG: raw}).decode())
    return ids

