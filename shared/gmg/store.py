"""The GMG's Redis store. Memory safety is enforced at commit by Lua scripts: a set of reservations is granted
all-or-nothing only if, on every device touched, reserved + new <= capacity - headroom. Everything that occupies
device memory is a reservation (weights, KV, lease buffers, staged guest weights); ``used`` is the measured figure
the worker reports, for inspection and for checking the accounting. Each change bumps
the GMG epoch and is appended to the change stream, inside the same script (atomic).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from shared.config import ClusterConfig, TenantsConfig
from shared.gmg.keys import GMGKeys

CHANGES_MAXLEN = 100_000

# KEYS: epoch, changes, then per device: device hash, reservations hash
# ARGV: n, now, then per reservation: device, owner, kind, tenant, bytes
_RESERVE = """
local n = tonumber(ARGV[1])
local now = ARGV[2]
local need = {}
for i = 0, n - 1 do
  local dkey = KEYS[3 + 2 * i]
  local rkey = KEYS[4 + 2 * i]
  local owner = ARGV[4 + 5 * i]
  if redis.call('HEXISTS', rkey, owner) == 1 then
    return {0, 'duplicate', ARGV[3 + 5 * i], owner}
  end
  if redis.call('EXISTS', dkey) == 0 then
    return {0, 'unknown_device', ARGV[3 + 5 * i], '0'}
  end
  need[dkey] = (need[dkey] or 0) + tonumber(ARGV[7 + 5 * i])
end
for dkey, bytes in pairs(need) do
  local limit = tonumber(redis.call('HGET', dkey, 'limit') or '0')
  local reserved = tonumber(redis.call('HGET', dkey, 'reserved') or '0')
  if reserved + bytes > limit then
    return {0, 'insufficient_memory', redis.call('HGET', dkey, 'id'), tostring(limit - reserved)}
  end
end
for i = 0, n - 1 do
  local dkey = KEYS[3 + 2 * i]
  local rkey = KEYS[4 + 2 * i]
  local b = tonumber(ARGV[7 + 5 * i])
  redis.call('HINCRBY', dkey, 'reserved', b)
  redis.call('HSET', rkey, ARGV[4 + 5 * i], ARGV[5 + 5 * i] .. '|' .. ARGV[6 + 5 * i] .. '|' .. b .. '|' .. now)
end
local epoch = redis.call('INCR', KEYS[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[#ARGV], '*', 'op', 'reserve', 'epoch', epoch, 'n', n,
           'device', ARGV[3], 'owner', ARGV[4])
return {1, 'ok', tostring(epoch), ''}
"""

# KEYS: epoch, changes, device hash, reservations hash; ARGV: owner, maxlen
_RELEASE = """
local v = redis.call('HGET', KEYS[4], ARGV[1])
if not v then return {0, '0'} end
local b = tonumber(string.match(v, '[^|]*|[^|]*|([^|]*)'))
redis.call('HDEL', KEYS[4], ARGV[1])
redis.call('HINCRBY', KEYS[3], 'reserved', -b)
local epoch = redis.call('INCR', KEYS[1])
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'op', 'release', 'epoch', epoch,
           'device', redis.call('HGET', KEYS[3], 'id'), 'owner', ARGV[1])
return {1, tostring(b)}
"""


@dataclass(frozen=True)
class Reservation:
    device: str
    owner: str  # e.g. "kv:<request_id>", "lease:<id>", "weights:<tenant>:<segment>"
    kind: str  # kv | weights | lease | activation | staging
    tenant: str
    nbytes: int


@dataclass(frozen=True)
class Refused:
    """A clean refusal: nothing was reserved anywhere."""

    reason: str  # insufficient_memory | unknown_device | duplicate
    device: str
    detail: str = ""


class GMGStore:
    """Reads and atomic commits of GMG state in Redis (used by the GMG service and by committers)."""

    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.keys = GMGKeys(prefix)
        self._reserve = redis.register_script(_RESERVE)
        self._release = redis.register_script(_RELEASE)

    # ------------------------------------------------------------ registry (GMG service)
    async def register_cluster(self, cluster: ClusterConfig, tenants: TenantsConfig) -> None:
        """Create/refresh device and tenant hashes; keeps live counters (used/reserved) of existing devices."""
        homes = {d: t.name for t in tenants.tenants for d in t.home_devices}
        pipe = self.redis.pipeline(transaction=True)
        for d in cluster.devices:
            limit = int(d.memory_bytes * (1 - cluster.headroom_fraction))
            pipe.hset(self.keys.device(d.id), mapping={
                "id": d.id, "backend": d.backend, "kind": d.kind, "host": d.host, "capacity": d.memory_bytes,
                "headroom": d.memory_bytes - limit, "limit": limit, "home_tenant": homes.get(d.id, ""),
                "label": "emulated" if d.backend == "emulated" else d.backend})
            pipe.hsetnx(self.keys.device(d.id), "used", 0)
            pipe.hsetnx(self.keys.device(d.id), "reserved", 0)
            pipe.hsetnx(self.keys.device(d.id), "state", "down")
            pipe.sadd(self.keys.devices, d.id)
        for t in tenants.tenants:
            pipe.hset(self.keys.tenant(t.name), mapping={
                "name": t.name, "model": t.model.preset or t.model.checkpoint or "config",
                "sla_ttft_ms": t.sla.ttft_ms, "sla_tpot_ms": t.sla.tpot_ms, "home_devices": ",".join(t.home_devices),
                "max_queue": t.max_queue})
            pipe.sadd(self.keys.tenants, t.name)
        pipe.incr(self.keys.epoch)
        await pipe.execute()

    # ------------------------------------------------------------ memory commits
    async def reserve(self, items: list[Reservation]) -> int | Refused:
        """Reserve all ``items`` atomically; returns the new epoch, or a :class:`Refused` (nothing reserved)."""
        keys = [self.keys.epoch, self.keys.changes]
        args: list = [len(items), f"{time.time():.6f}"]
        for r in items:
            if r.nbytes < 0:
                return Refused("invalid", r.device, "negative size")
            keys += [self.keys.device(r.device), self.keys.reservations(r.device)]
            args += [r.device, r.owner, r.kind, r.tenant, int(r.nbytes)]
        args.append(CHANGES_MAXLEN)
        ok, reason, a, b = await self._reserve(keys=keys, args=args)
        if int(ok) == 1:
            return int(a)
        return Refused(_s(reason), _s(a), _s(b))

    async def release(self, device: str, owner: str) -> int:
        """Release one reservation (idempotent); returns the bytes freed (0 if there was none)."""
        ok, b = await self._release(keys=[self.keys.epoch, self.keys.changes, self.keys.device(device),
                                          self.keys.reservations(device)], args=[owner, CHANGES_MAXLEN])
        return int(b)

    async def reservations(self, device: str) -> dict[str, Reservation]:
        raw = await self.redis.hgetall(self.keys.reservations(device))
        out = {}
        for k, v in raw.items():
            kind, tenant, nbytes, _ts = _s(v).split("|")
            out[_s(k)] = Reservation(device, _s(k), kind, tenant, int(nbytes))
        return out

    # ------------------------------------------------------------ live device state (GMG service)
    async def update_device(self, device: str, fields: dict) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(self.keys.device(device), mapping={k: str(v) for k, v in fields.items()})
        pipe.incr(self.keys.epoch)
        await pipe.execute()

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


def _s(v) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)
