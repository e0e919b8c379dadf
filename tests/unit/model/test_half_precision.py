"""Half-precision code paths (bfloat16 on CPU; float16/bfloat16 on CUDA when a GPU is present)."""
from __future__ import annotations

import pytest
import torch

from shared.model.batch import SeqChunk, build_context
from shared.model.config import PRESETS
from shared.model.engine import Engine, SamplingParams
from shared.model.llama import LlamaModel
from shared.model.tokenizer import ByteTokenizer


def _segment_vs_reference(model: LlamaModel, atol: float) -> None:
    ids = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = model.forward_reference(ids)
    kv = model.new_kv_cache(8, 8)
    kv.allocate("s", 24)
    outs = []
    for start, n in ((0, 13), (13, 1), (14, 7)):
        ctx = build_context(kv, [SeqChunk("s", start, n)])
        h = torch.tensor(ids[start:start + n], device=model.device)
        for name in model.segments:
            h = model.run_segment(name, h, ctx)
        outs.append(h)
    got = torch.cat(outs)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert (got - ref).abs().max().item() < atol


def test_bfloat16_on_cpu():
    model = LlamaModel(PRESETS["tiny-2l"].with_(dtype="bfloat16"), seed=2)
    assert model.weight_bytes == model.cfg.weight_bytes()
    _segment_vs_reference(model, atol=0.1)
    eng = Engine(model, ByteTokenizer(model.cfg), kv_blocks=16, block_size=8)
    eng.add("r", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.7, seed=1))
    while eng.has_work():
        eng.step()
    assert eng.kv_bytes_per_block == 8 * model.cfg.kv_bytes_per_token()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,atol", [("float32", 1e-3), ("float16", 0.05), ("bfloat16", 0.1)])
def test_cuda_segment_path_and_engine(dtype, atol):
    cpu = LlamaModel(PRESETS["tiny"].with_(dtype=dtype), seed=4)
    gpu = LlamaModel(PRESETS["tiny"].with_(dtype=dtype), "cuda", seed=4)
    _segment_vs_reference(gpu, atol=atol)
    tok = ByteTokenizer(gpu.cfg)
    outs = []
    for m in (cpu, gpu):
        eng = Engine(m, tok, kv_blocks=32, block_size=16, max_batch_tokens=16)
        eng.add("s", [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.8, seed=9, ignore_eos=True))
        eng.add("g", list(range(40)), SamplingParams(max_tokens=8, ignore_eos=True))
        got: dict[str, list[int]] = {}
        while eng.has_work():
            for ev in eng.step().events:
                got.setdefault(ev.request_id, []).extend(ev.token_ids)
        outs.append(got)
    assert all(len(v) == 8 for v in outs[1].values())
    if dtype == "float32":
        assert outs[0] == outs[1]
