"""The GMG's Redis store. Memory safety is enforced at commit by Lua scripts: a set of reservations is granted
all-or-nothing only if, on every device touched, reserved + new <= capacity - headroom (``limit``). Everything that
occupies device memory is a reservation (weights, KV, lease buffers, activations, staged guest weights); ``used`` is
the measured figure the worker reports, for inspection and for checking the accounting.

Every write (commits by schedulers, structure and live state by the GMG service) bumps the GMG epoch and appends one
replayable entry to the change stream inside the same script (:mod:`shared.gmg.mutations`), so a follower can
rebuild the GMG from a snapshot plus the stream. Leases and weight staging live in :mod:`shared.gmg.lease_store`.
"""
from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec
import redis.asyncio as aioredis

from shared.config import ClusterConfig, ModelSpec, TenantsConfig
from shared.gmg.keys import GMGKeys
from shared.gmg.mutations import APPLY_SCRIPT, MutationBatch
from shared.redis_util import LuaScript, run_pipeline
from shared.gmg.scripts import COMMIT, RELEASE
from shared.model.config import ModelConfig
from shared.model.graph import ModelGraph

CHANGES_MAXLEN = 100_000


@dataclass(frozen=True)
class Reservation:
    """Memory held on a device by ``owner``; ``nbytes`` counts against the device's limit."""

    device: str
    owner: str  # e.g. "kv:<request_id>", "lease:<id>", "weights:<tenant>:<segment>", "act:<id>"
    kind: str  # kv | weights | lease | activation | staging
    tenant: str
    nbytes: int


@dataclass(frozen=True)
class Resize:
    """Set an existing reservation to ``nbytes`` (KV growth or shrink); growth is checked like a new reservation."""

    device: str
    owner: str
    nbytes: int


@dataclass(frozen=True)
class Refused:
    """A clean refusal: nothing was reserved or changed anywhere."""

    reason: str  # insufficient_memory | unknown_device | duplicate | unknown_owner | conflict | invalid
    device: str
    detail: str = ""


@dataclass(frozen=True)
class Room:
    """Lets a commit make room on ``device``: where its items do not fit, the same script first evicts weights
    staged there that no active lease pins, least recently leased first (``recency``: ``"tenant|segment"`` -> when
    last leased; entries it does not list count as oldest), never the device's home tenant's nor ``keep``'s, until
    they fit; when even all of them would not make room, the commit is refused and nothing is evicted."""

    device: str
    keep: tuple[str, ...] = ()
    recency: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Committed:
    """A commit made with :class:`Room` s: its epoch and the staged weights it evicted to fit."""

    epoch: int
    evicted: tuple[tuple[str, str, str, int], ...] = ()  # (device, tenant, segment, bytes freed)


_APPLY, _COMMIT, _RELEASE = LuaScript(APPLY_SCRIPT), LuaScript(COMMIT), LuaScript(RELEASE)

Guard = tuple[str, str, tuple[str, ...]]  # (hash key, field, accepted values: '' = missing, '*' = any present)


class GMGStore:
    """Reads and atomic commits of GMG state in Redis (used by the GMG service and by committers)."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.keys = GMGKeys(prefix)

    async def _eval(self, script: LuaScript, keys: list[str], args: list, *, durable: bool = True):
        """Run one GMG script. Memory commits and releases are ``durable``: on a Redis Cluster they return only
        once a replica of the ``{gmg}`` master has them (a failover then loses no reservation); the GMG service's
        live state (heartbeats, steps) is rewritten continuously and goes without."""
        return (await run_pipeline(self.redis, lambda p: script.queue(p, keys, args), scripts=[script],
                                   replicate=keys[:1] if durable else ()))[0]

    def batch(self) -> MutationBatch:
        """A new mutation batch for :meth:`apply` / :meth:`commit`."""
        return MutationBatch(self.keys.epoch, self.keys.changes)

    # ------------------------------------------------------------ generic writes
    async def apply(self, op: str, batch: MutationBatch) -> int:
        """Apply ``batch`` atomically with an epoch bump and a change entry named ``op``; returns the epoch."""
        if not len(batch):
            return await self.epoch()
        keys, args = batch.script_args(op, CHANGES_MAXLEN)
        return int(await self._eval(_APPLY, keys, args, durable=False))

    async def commit(self, op: str, items: list[Reservation | Resize], *, guards: list[Guard] = (),
                     batch: MutationBatch | None = None) -> int | Refused:
        """Reserve/resize ``items``, check ``guards`` and apply ``batch``, all or nothing; epoch or Refused."""
        res = await self.commit_making_room(op, items, (), guards=guards, batch=batch)
        return res if isinstance(res, Refused) else res.epoch

    async def commit_making_room(self, op: str, items: list[Reservation | Resize], rooms: list[Room], *,
                                 guards: list[Guard] = (), batch: MutationBatch | None = None) -> Committed | Refused:
        """:meth:`commit`, evicting cached staged weights on the devices of ``rooms`` where the items do not fit
        otherwise (see :class:`Room`) — in the same script, so one round trip grants or refuses with nothing
        changed; returns what it evicted."""
        b = batch or self.batch()
        spec_items = []
        for r in items:
            if r.nbytes < 0:
                return Refused("invalid", r.device, "negative size")
            dk, rk = b.key_index(self.keys.device(r.device)), b.key_index(self.keys.reservations(r.device))
            if isinstance(r, Reservation):
                spec_items.append(["new", dk, rk, r.owner, r.kind, r.tenant, str(int(r.nbytes)), r.device])
            else:
                spec_items.append(["resize", dk, rk, r.owner, "", "", str(int(r.nbytes)), r.device])
        spec_guards = [[b.key_index(k), f, *acc] for k, f, acc in guards]
        k = self.keys
        spec_rooms = [[b.key_index(k.device(r.device)), b.key_index(k.resident(r.device)),
                       b.key_index(k.pins(r.device)), b.key_index(k.reservations(r.device)), list(r.keep),
                       {f: float(t) for f, t in r.recency.items()}, r.device] for r in rooms]
        spec = msgspec.msgpack.encode([spec_items, spec_guards, b.muts, f"{time.time():.6f}", spec_rooms])
        ok, reason, a, c = await self._eval(_COMMIT, b.keys, [op, spec, CHANGES_MAXLEN, *b.blobs])
        if int(ok) != 1:
            return Refused(_s(reason), _s(a), _s(c))
        evicted = tuple((_s(d), _s(t), _s(g), int(n)) for d, t, g, n in msgspec.msgpack.decode(c)) if c else ()
        return Committed(int(a), evicted)

    async def release_many(self, op: str, owners: list[tuple[str, str]], *, guards: list[Guard] = (),
                           batch: MutationBatch | None = None) -> tuple[int, int] | Refused:
        """Release ``(device, owner)`` pairs (missing ones are skipped) plus ``batch``; (freed bytes, epoch)."""
        b = batch or self.batch()
        spec_items = [[b.key_index(self.keys.device(d)), b.key_index(self.keys.reservations(d)), o] for d, o in owners]
        spec_guards = [[b.key_index(k), f, *acc] for k, f, acc in guards]
        spec = msgspec.msgpack.encode([spec_items, spec_guards, b.muts])
        ok, freed, epoch, extra = await self._eval(_RELEASE, b.keys, [op, spec, CHANGES_MAXLEN])
        if _s(freed) == "conflict":
            return Refused("conflict", "", f"{_s(epoch)}={_s(extra)}")
        return int(freed), int(epoch)

    # ------------------------------------------------------------ registry (GMG service)
    async def register_cluster(self, cluster: ClusterConfig, tenants: TenantsConfig) -> int:
        """Create/refresh device and tenant hashes, model graphs and home residency; keeps live device fields."""
        homes = tenants.home_of()
        existing = await self.devices()
        b = self.batch()
        for d in cluster.devices:
            limit = int(d.memory_bytes * (1 - cluster.headroom_fraction))
            fields = {"id": d.id, "backend": d.backend, "kind": d.kind, "host": d.host, "capacity": d.memory_bytes,
                      "headroom": d.memory_bytes - limit, "limit": limit, "home_tenant": homes.get(d.id, ""),
                      "label": "emulated" if d.backend == "emulated" else d.backend}
            for f, default in (("used", "0"), ("reserved", "0"), ("state", "down")):
                if f not in existing.get(d.id, {}):
                    fields[f] = default
            b.hset(self.keys.device(d.id), fields)
            b.add("sadd", self.keys.devices, d.id)
        for t in tenants.tenants:
            b.hset(self.keys.tenant(t.name), {
                "name": t.name, "model": t.model.preset or t.model.checkpoint or "config",
                "sla_ttft_ms": t.sla.ttft_ms, "sla_tpot_ms": t.sla.tpot_ms, "home_devices": ",".join(t.home_devices),
                "max_queue": t.max_queue, "weight_bytes": t.model.config.weight_bytes(),
                "kv_bytes_per_token": t.model.config.kv_bytes_per_token(), "model_id": model_id(t.model)})
            b.add("sadd", self.keys.tenants, t.name)
            blob, seg_bytes = _graph(t.model.config)
            b.setblob(self.keys.model_graph(t.name), blob)
            for d in t.home_devices:  # a home holds all its tenant's weights (DESIGN §4)
                b.hset(self.keys.resident(d), {f"{t.name}|{s}": n for s, n in seg_bytes})
        return await self.apply("register", b)

    # ------------------------------------------------------------ memory commits
    async def reserve(self, items: list[Reservation]) -> int | Refused:
        """Reserve all ``items`` atomically; returns the new epoch, or a :class:`Refused` (nothing reserved)."""
        return await self.commit("reserve", items)

    async def resize(self, device: str, owner: str, nbytes: int) -> int | Refused:
        """Grow or shrink an existing reservation to ``nbytes`` (growth refused past the device's limit)."""
        return await self.commit("resize", [Resize(device, owner, nbytes)])

    async def release(self, device: str, owner: str) -> int:
        """Release one reservation (idempotent); returns the bytes freed (0 if there was none)."""
        res = await self.release_many("release", [(device, owner)])
        return 0 if isinstance(res, Refused) else res[0]

    async def reservations(self, device: str) -> dict[str, Reservation]:
        raw = await self.redis.hgetall(self.keys.reservations(device))
        out = {}
        for k, v in raw.items():
            kind, tenant, nbytes, _ts = _s(v).split("|")
            out[_s(k)] = Reservation(device, _s(k), kind, tenant, int(nbytes))
        return out

    # ------------------------------------------------------------ live device state (GMG service)
    async def update_device(self, device: str, fields: dict, op: str = "device_update") -> int:
        """Set plain fields of a device hash (live state written by the GMG service); returns the epoch."""
        return await self.apply(op, self.batch().hset(self.keys.device(device), fields))

    async def device(self, device: str) -> dict[str, str]:
        return {_s(k): _s(v) for k, v in (await self.redis.hgetall(self.keys.device(device))).items()}

    async def devices(self) -> dict[str, dict[str, str]]:
        ids = sorted(_s(x) for x in await self.redis.smembers(self.keys.devices))
        pipe = self.redis.pipeline(transaction=False)
        for i in ids:
            pipe.hgetall(self.keys.device(i))
        rows = await pipe.execute()
        return {i: {_s(k): _s(v) for k, v in r.items()} for i, r in zip(ids, rows)}

    async def epoch(self) -> int:
        return int(await self.redis.get(self.keys.epoch) or 0)


def model_id(spec: ModelSpec) -> str:
    """A fingerprint of a tenant's model (source, seed and shape): a restart that changes it makes the weights
    staged for the tenant elsewhere stale (``services/gmg/reconcile.py``)."""
    return hashlib.sha256(repr((spec.preset, spec.checkpoint, spec.seed, spec.config)).encode()).hexdigest()[:16]


def segment_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Weight bytes of each segment of a model (what a home holds resident, segment by segment)."""
    return dict(_graph(cfg)[1])


@functools.lru_cache(maxsize=64)
def _graph(cfg: ModelConfig) -> tuple[bytes, tuple[tuple[str, int], ...]]:
    """MessagePack of the model's operator graph and each segment's weight bytes."""
    graph = ModelGraph.from_config(cfg)
    return msgspec.msgpack.encode(graph.to_dict()), tuple((s.name, s.weight_bytes) for s in graph.segments)


def _s(v) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)
