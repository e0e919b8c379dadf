"""A hand-off's KV over the segment RPC (services/worker/handoff.py): a guest's KVExports served by a real segment
server, fetched by ``fetch_kv`` through the shared reply reader (``SegmentClient.tensor_replies``)."""
from __future__ import annotations

import pytest
import torch

from services.worker.handoff import KVExports, fetch_kv
from services.worker.segment_server import SegmentClient, SegmentServer, TensorMover
from services.worker.segment_wire import FrameError, KVQuery, KVTensor


class Guest:
    def __init__(self, exports: KVExports, mover: TensorMover, answer_as: str | None = None) -> None:
        self.exports, self.mover, self.answer_as = exports, mover, answer_as

    def handle(self, msg, payload):
        if self.answer_as is not None:  # a confused peer: answers for another sequence
            return [(KVTensor(request_id=self.answer_as), b"")]
        return self.exports.handle(msg, self.mover)


@pytest.fixture
def served():
    made = []

    def make(answer_as=None):
        exports = KVExports()
        server = SegmentServer(Guest(exports, TensorMover("g0"), answer_as), torch_threads=1)
        client = SegmentClient(server.start())
        made.append((server, client))
        return exports, client
    yield make
    for server, client in made:
        client.close()
        server.close()


def _kv(layers: int, positions: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(positions)
    return [(torch.randn(2, positions, 8, generator=g), torch.randn(2, positions, 8, generator=g))
            for _ in range(layers)]


def test_the_home_gets_every_layer_bit_identical(served):
    exports, client = served()
    kv = _kv(3, 700)  # inline frames (no tensor transport here); the clone outlives each frame's buffer
    exports.put("r1", "tok", "h0", kv)
    got = fetch_kv(client, TensorMover("h0"), KVQuery(request_id="r1", token="tok", home_device="h0"))
    assert len(got) == 3
    for (k, v), (k2, v2) in zip(kv, got):
        assert torch.equal(k, k2) and torch.equal(v, v2)


def test_a_sequence_without_tensors_is_an_empty_list(served):
    exports, client = served()
    exports.put("r0", "tok", "h0", [])
    assert fetch_kv(client, TensorMover("h0"), KVQuery(request_id="r0", token="tok", home_device="h0")) == []


@pytest.mark.parametrize("token, home", [("other", "h0"), ("tok", "h9")])
def test_a_wrong_token_or_home_is_refused(served, token, home):
    exports, client = served()
    exports.put("r1", "tok", "h0", _kv(1, 4))
    with pytest.raises(RuntimeError, match="refused the KV of r1: unknown_sequence"):
        fetch_kv(client, TensorMover(home), KVQuery(request_id="r1", token=token, home_device=home))


def test_a_reply_for_another_sequence_is_a_frame_error(served):
    _, client = served(answer_as="r2")
    with pytest.raises(FrameError, match="unexpected reply KVTensor to a query for the KV of r1"):
        fetch_kv(client, TensorMover("h0"), KVQuery(request_id="r1", token="tok", home_device="h0"))
