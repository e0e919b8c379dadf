"""The cost model against measured GPU timings: Vidur's operator and send/recv profiles (reading and comparing).

Vidur (github.com/microsoft/vidur, ``data/profiling/``, commit 7d47513, MIT license) measured, on H100 and A100
GPUs, every operator of one Llama-family transformer layer (plus the embedding) over batches of 1 … 4096 tokens
and tensor-parallel degrees 1 … 8, and NCCL send/recv and all-reduce over message sizes. The project keeps a
gzip-compressed copy outside the repository (``../shared/profiles/vidur``, files named after the original paths
with ``/`` replaced by ``__``). This module reads it and scores a :class:`~shared.costmodel.profiles.DeviceProfile`
against it: every TP-1 row of every operator is predicted through :func:`~shared.costmodel.model_cost.op_time`
(exactly what the simulator computes) on the operator graph of the measured model's shape, and every send/recv
row through :func:`~shared.costmodel.transfer.transfer_time`. The statistic taken from the files is each row's
median (ms). Attention kernels are not in the data: they stay modelled from first principles. Pure functions, no
CLI; the fit lives in :mod:`shared.costmodel.measured_fit`.
"""
from __future__ import annotations

import csv
import gzip
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from shared.config_error import ConfigError
from shared.costmodel.model_cost import op_time
from shared.costmodel.profiles import DeviceProfile
from shared.costmodel.transfer import transfer_time
from shared.model.config import ModelConfig
from shared.model.graph import ModelGraph

VIDUR_SOURCE = "Vidur (github.com/microsoft/vidur, data/profiling/), commit 7d47513, MIT license"
DEFAULT_DIR = "../shared/profiles/vidur"
GPU_KINDS = {"h100": "h100-80gb", "a100": "a100-80gb"}  # Vidur's GPU name -> profile kind
FAMILIES = ("gemm", "norm", "rotary", "activation", "residual", "embedding")
# Vidur's operator column -> (the operator of a one-layer graph it measures, operator family)
OPERATORS: dict[str, tuple[str, str]] = {
    "attn_pre_proj": ("attn[0].qkv_proj", "gemm"),
    "attn_post_proj": ("attn[0].o_proj", "gemm"),
    "mlp_up_proj": ("mlp[0].gate_up_proj", "gemm"),
    "mlp_down_proj": ("mlp[0].down_proj", "gemm"),
    "input_layernorm": ("attn[0].input_norm", "norm"),
    "post_attention_layernorm": ("mlp[0].post_norm", "norm"),
    "attn_rope": ("attn[0].rope", "rotary"),
    "mlp_act": ("mlp[0].silu_mul", "activation"),
    "add": ("mlp[0].residual", "residual"),
    "emb": ("embed.embed_tokens", "embedding"),
}
# send/recv files: topology -> (GPU, what the two ranks are connected by when they share a node)
NVLINK_TOPOLOGIES = {"h100_dgx": "h100", "a100_dgx": "a100"}  # 8 GPUs on NVSwitch: the profiles' nvlink
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "num_tokens",
                 "num_tensor_parallel_workers")
_NETWORK = re.compile(r"^network__(?P<topology>[a-z0-9_]+?)__send_recv\.csv\.gz$")


def _compute_name(name: str) -> tuple[str, str] | None:
    """(gpu, org/model) of a ``compute__<gpu>__<org>__<model>-mlp.csv.gz`` file name, else None."""
    suffix = "-mlp.csv.gz"
    parts = name[:-len(suffix)].split("__") if name.endswith(suffix) else []
    return (parts[1], f"{parts[2]}/{parts[3]}") if len(parts) == 4 and parts[0] == "compute" else None


@dataclass(frozen=True)
class ComputeTable:
    """TP-1 rows of one model's operator timings on one GPU: ``rows`` holds (tokens, {column: seconds})."""

    gpu: str
    model: str
    path: str
    config: ModelConfig
    rows: tuple[tuple[int, dict[str, float]], ...]


@dataclass(frozen=True)
class TransferTable:
    """send/recv between 2 ranks: ``rows`` holds (bytes, seconds) for ranks in one node (``intra``) or in two."""

    topology: str
    path: str
    intra: tuple[tuple[int, float], ...]
    inter: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class Measurements:
    """Everything read from one directory."""

    root: str
    compute: tuple[ComputeTable, ...]
    transfer: tuple[TransferTable, ...]

    def gpus(self) -> list[str]:
        return sorted({t.gpu for t in self.compute})

    def compute_for(self, gpu: str) -> list[ComputeTable]:
        return [t for t in self.compute if t.gpu == gpu]


@dataclass(frozen=True)
class OpError:
    """One measured row of one operator and the cost model's prediction of it."""

    gpu: str
    model: str
    column: str
    family: str
    tokens: int
    measured_s: float
    predicted_s: float

    @property
    def error(self) -> float:
        """Signed relative error (predicted − measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


def _rows(path: Path) -> list[dict[str, str]]:
    try:
        with gzip.open(path, "rt", newline="") as f:
            return list(csv.DictReader(f))
    except (OSError, EOFError, csv.Error, UnicodeDecodeError) as e:
        raise ConfigError(path, "(file)", f"cannot read a gzip-compressed CSV: {e}") from None


def _number(row: dict[str, str], col: str, path: Path, line: int, kind: type = float) -> float:
    raw = row.get(col)
    if raw is None or raw == "":
        raise ConfigError(path, f"row {line}.{col}", "missing")
    try:
        v = kind(float(raw)) if kind is int else float(raw)
    except ValueError:
        raise ConfigError(path, f"row {line}.{col}", f"expected a number, got {raw!r}") from None
    if not v > 0:
        raise ConfigError(path, f"row {line}.{col}", f"must be positive, got {raw!r}")
    return v


def read_compute(path: str | Path, gpu: str, model: str, tp: int = 1) -> ComputeTable:
    """The ``num_tensor_parallel_workers == tp`` rows of one ``compute/<gpu>/<model>-mlp.csv.gz`` file."""
    p = Path(path)
    raw = _rows(p)
    if not raw:
        raise ConfigError(p, "(file)", "no rows")
    missing = [c for c in (*SHAPE_COLUMNS, *(f"time_stats.{k}.median" for k in OPERATORS)) if c not in raw[0]]
    if missing:
        raise ConfigError(p, missing[0], "column missing (not a Vidur compute profile?)")
    rows, shape = [], None
    for i, r in enumerate(raw, start=2):  # line 1 is the header
        if int(_number(r, "num_tensor_parallel_workers", p, i, int)) != tp:
            continue
        s = tuple(int(_number(r, c, p, i, int)) for c in SHAPE_COLUMNS[:5])
        if shape is None:
            shape = s
        elif s != shape:
            raise ConfigError(p, f"row {i}", f"model shape {s} differs from the first row's {shape}")
        rows.append((int(_number(r, "num_tokens", p, i, int)),
                     {k: _number(r, f"time_stats.{k}.median", p, i) / 1e3 for k in OPERATORS}))
    if shape is None:
        raise ConfigError(p, "num_tensor_parallel_workers", f"no rows with tensor parallelism {tp}")
    n_head, n_kv, n_embd, n_exp, vocab = shape
    cfg = ModelConfig(vocab_size=vocab, hidden_size=n_embd, intermediate_size=n_exp, num_hidden_layers=1,
                      num_attention_heads=n_head, num_key_value_heads=n_kv, max_position_embeddings=4096,
                      dtype="float16")
    problems = cfg.validate()
    if problems:
        raise ConfigError(p, "(shape)", problems[0])
    return ComputeTable(gpu, model, str(p), cfg, tuple(sorted(rows, key=lambda r: r[0])))


def read_send_recv(path: str | Path, topology: str) -> TransferTable:
    """One ``network/<topology>/send_recv.csv.gz`` file: sizes are bytes, times the median (s)."""
    p = Path(path)
    raw = _rows(p)
    col = "time_stats.send_recv.median"
    if not raw or col not in raw[0] or "size" not in raw[0] or "devices_per_node" not in raw[0]:
        raise ConfigError(p, col if raw else "(file)", "missing (not a Vidur send_recv profile?)")
    intra, inter = [], []
    for i, r in enumerate(raw, start=2):
        size, t = int(_number(r, "size", p, i, int)), _number(r, col, p, i) / 1e3
        (intra if int(_number(r, "devices_per_node", p, i, int)) >= 2 else inter).append((size, t))
    return TransferTable(topology, str(p), tuple(sorted(intra)), tuple(sorted(inter)))


def load_measurements(root: str | Path, gpus: Iterable[str] | None = None) -> Measurements:
    """Every compute and send/recv file in ``root`` (optionally only of ``gpus``); a clear error when the
    directory is missing or holds no compute profiles."""
    r = Path(root)
    if not r.is_dir():
        raise ConfigError(r, "(directory)", "measured timings not found (expected Vidur's profiles, see its README)")
    want = set(gpus) if gpus else None
    compute, transfer = [], []
    for p in sorted(r.iterdir()):
        c = _compute_name(p.name)
        if c and c[0] in GPU_KINDS and (want is None or c[0] in want):
            compute.append(read_compute(p, *c))
        n = _NETWORK.match(p.name)
        if n:
            transfer.append(read_send_recv(p, n["topology"]))
    if not compute:
        raise ConfigError(r, "(directory)", "no compute__<gpu>__<org>__<model>-mlp.csv.gz files"
                          + (f" for {', '.join(sorted(want))}" if want else ""))
    return Measurements(str(r), tuple(compute), tuple(transfer))


def compute_errors(profile: DeviceProfile, table: ComputeTable) -> list[OpError]:
    """Every (row, operator) of ``table`` predicted by ``profile``."""
    graph = ModelGraph.from_config(table.config)
    ops = {col: graph.operator(name) for col, (name, _) in OPERATORS.items()}
    return [OpError(table.gpu, table.model, col, OPERATORS[col][1], t, y, op_time(profile, ops[col], t))
            for t, times in table.rows for col, y in times.items()]


def transfer_errors(profile: DeviceProfile, rows: Iterable[tuple[int, float]], link: str = "nvlink"
                    ) -> list[tuple[int, float, float]]:
    """(bytes, measured s, predicted s) of send/recv rows over ``link`` of ``profile``."""
    return [(n, y, transfer_time(profile, link, n)) for n, y in rows]


def mape(errors: Iterable[float]) -> float:
    """Mean absolute relative error of signed relative errors (nan for none)."""
    e = [abs(x) for x in errors]
    return sum(e) / len(e) if e else float("nan")


def transfer_mape(rows: Iterable[tuple[int, float, float]]) -> float:
    return mape((p - y) / y for _, y, p in rows)


def size_range(nbytes: int) -> str:
    """The message-size range a send/recv row is summarised in."""
    return "<1MiB" if nbytes < 2 ** 20 else "1-16MiB" if nbytes <= 2 ** 24 else ">16MiB"


def token_range(tokens: int) -> str:
    """The token range a row is summarised in (decode-sized, mid, prefill-sized batches)."""
    return "1-64" if tokens <= 64 else "65-512" if tokens <= 512 else ">512"


def compare(profiles: dict[str, DeviceProfile], data: Measurements) -> dict:
    """The comparison of ``profiles`` (Vidur GPU name -> profile) with ``data``: MAPE per (GPU, model, family),
    per (GPU, family, token range), and per send/recv topology (intra-node rows over ``nvlink``, inter-node rows
    over ``nccl``). Plain data, ready for JSON."""
    out: dict = {"compute": [], "by_tokens": [], "transfer": []}
    for gpu, prof in sorted(profiles.items()):
        errs = [e for t in data.compute_for(gpu) for e in compute_errors(prof, t)]
        counts: dict[tuple[str, str], list] = {}
        for e in errs:
            for key in ((e.model, e.family), ("all", e.family)):
                counts.setdefault(key, []).append(e.error)
        for (model, fam), v in sorted(counts.items()):
            out["compute"].append({"gpu": gpu, "profile": prof.kind, "model": model, "family": fam,
                                   "rows": len(v), "mape": mape(v), "worst": max(abs(x) for x in v),
                                   "signed_mean": sum(v) / len(v)})
        ranges: dict[tuple[str, str], list] = {}
        for e in errs:
            ranges.setdefault((e.family, token_range(e.tokens)), []).append(e.error)
        out["by_tokens"] += [{"gpu": gpu, "family": f, "tokens": r, "rows": len(v), "mape": mape(v)}
                             for (f, r), v in sorted(ranges.items())]
    for t in data.transfer:
        gpu = t.topology.split("_", 1)[0]
        prof = profiles.get(gpu)
        if prof is None:
            continue
        for scope, rows, link in (("intra-node", t.intra, "nvlink"), ("inter-node", t.inter, "nccl")):
            if rows and link in prof.links:
                pred = transfer_errors(prof, rows, link)
                sizes: dict[str, list] = {}
                for n, y, p in pred:
                    sizes.setdefault(size_range(n), []).append((p - y) / y)
                out["transfer"].append({"gpu": gpu, "topology": t.topology, "scope": scope, "link": link,
                                        "rows": len(rows), "bytes": [rows[0][0], rows[-1][0]],
                                        "mape": transfer_mape(pred), "by_size": {k: mape(v) for k, v in sizes.items()},
                                        "worst": max(abs(p - y) / y for _, y, p in pred)})
    return out
