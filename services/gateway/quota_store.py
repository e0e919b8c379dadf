"""Tenant bounds shared by every gateway instance, counted atomically in Redis.

Each gateway keeps its own exact counts (:class:`services.gateway.admission.Admission`); this module makes the
bounds hold across all replicas: a tenant's in-flight count against ``max_queue`` and ``quota.max_concurrency``,
its tokens of the last minute against ``quota.tokens_per_min``, and the in-flight total against
``SLICESCHED_MAX_INFLIGHT``. One Lua script checks them in the same order as the local checks and, if all pass,
counts the request, so N replicas give a tenant its quota, not N times it.

Keys (all under the ``{quota}`` hash tag: one slot, so one script can read and write them on a Redis Cluster):

* ``{quota}:gateways`` (sorted set): gateway id -> end of its lease (Redis server time, ms). A gateway renews its
  lease every ``RENEW_S``; the counts of a gateway whose lease ended (it died, or stalled past ``LEASE_MS``) are
  ignored and deleted by the next admission.
* ``{quota}:inflight`` and ``{quota}:inflight:{tenant}`` (hashes): gateway id -> requests in flight there, in total
  and per tenant.
* ``{quota}:held:{gateway}`` (hash): request id -> ``tenant|tokens|second`` of each request the gateway holds, so
  admitting and releasing are idempotent by request id: a release retried after a Redis error counts once.
* ``{quota}:gone:{request id}`` (string, 2 min): a release that found nothing to release (its admission timed out
  at the gateway and has not reached Redis); the late admission then counts nothing.
* ``{quota}:tokens:{tenant}`` (hash): unix second -> tokens (prompt + max_tokens) admitted in that second; the
  window is the last 60 one-second buckets (the local window is exact to the microsecond; this one to the second).

Redis's clock (``TIME`` inside the scripts) is the only clock, so gateways on different hosts need not agree.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from shared.config import TenantConfig
from shared.redis_util import REDIS_ERRORS, LuaScript, run_pipeline

log = structlog.get_logger()

LEASE_MS = 5000  # a gateway silent this long is dead: its counts stop counting
RENEW_S = 1.0
WINDOW_S = 60
GONE_MS = 120_000
RELEASE_RETRY_S = 120.0  # a release is retried (idempotent) this long while Redis is unreachable

# KEYS: gateways, inflight total, inflight tenant, tokens tenant, held (this gateway), gone (this request)
# ARGV: gateway, request id, tenant, tokens, max_queue, max_concurrency (0 = none), tokens_per_min (0 = none),
#       max_inflight, lease_ms, window_s, force ('1': count without checking: the gateway decided alone)
# -> {'ok', tenant in flight, second} | {reason, count, retry_after_s}
ADMIT = LuaScript("""
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local gw, rid, tenant, tokens = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local max_queue, max_conc, tpm = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local max_inflight, lease_ms, window = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])
local force = ARGV[11] == '1'
if redis.call('EXISTS', KEYS[6]) == 1 then return {'released', 0, 1} end
if redis.call('HEXISTS', KEYS[5], rid) == 1 then return {'ok', 0, 0} end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
redis.call('ZADD', KEYS[1], now_ms + lease_ms, gw)
local function live_sum(key)
  local flat = redis.call('HGETALL', key)
  local sum = 0
  for i = 1, #flat, 2 do
    if flat[i] == gw or redis.call('ZSCORE', KEYS[1], flat[i]) then
      sum = sum + tonumber(flat[i + 1])
    else
      redis.call('HDEL', key, flat[i])
    end
  end
  return sum
end
local tin = live_sum(KEYS[3])
if not force and tin >= max_queue then return {'queue_full', tin, 1} end
if not force and max_conc > 0 and tin >= max_conc then return {'concurrency', tin, 1} end
local sec = math.floor(now_ms / 1000)
if tpm > 0 then
  local flat = redis.call('HGETALL', KEYS[4])
  local used, buckets = 0, {}
  for i = 1, #flat, 2 do
    local s, n = tonumber(flat[i]), tonumber(flat[i + 1])
    if s <= sec - window then
      redis.call('HDEL', KEYS[4], flat[i])
    else
      used = used + n
      buckets[#buckets + 1] = {s, n}
    end
  end
  if not force and used + tokens > tpm then
    local retry = window
    if tokens <= tpm then
      table.sort(buckets, function(a, b) return a[1] < b[1] end)
      local need = used + tokens - tpm
      for _, b in ipairs(buckets) do
        need = need - b[2]
        if need <= 0 then
          retry = math.max(1, b[1] + window - sec)
          break
        end
      end
    end
    return {'tokens', used, retry}
  end
else
  tokens = 0
end
if max_inflight > 0 and not force then
  local total = live_sum(KEYS[2])
  if total >= max_inflight then return {'overloaded', total, 1} end
end
redis.call('HINCRBY', KEYS[3], gw, 1)
redis.call('HINCRBY', KEYS[2], gw, 1)
redis.call('HSET', KEYS[5], rid, tenant .. '|' .. tokens .. '|' .. sec)
for i = 2, 3 do redis.call('EXPIRE', KEYS[i], 3600) end
redis.call('EXPIRE', KEYS[5], 3600)
if tokens > 0 then
  redis.call('HINCRBY', KEYS[4], sec, tokens)
  redis.call('EXPIRE', KEYS[4], window * 2)
end
return {'ok', tin + 1, sec}
""")

# KEYS: inflight total, inflight tenant, tokens tenant, held (this gateway), gone (this request)
# ARGV: gateway, request id, refund (1: give the tokens back), gone_ms
RELEASE = LuaScript("""
local v = redis.call('HGET', KEYS[4], ARGV[2])
if not v then
  redis.call('SET', KEYS[5], '1', 'PX', ARGV[4])
  return 0
end
redis.call('HDEL', KEYS[4], ARGV[2])
for i = 1, 2 do
  if redis.call('HINCRBY', KEYS[i], ARGV[1], -1) <= 0 then redis.call('HDEL', KEYS[i], ARGV[1]) end
end
local _, _, tokens, sec = string.find(v, '^[^|]*|([^|]*)|([^|]*)$')
tokens = tonumber(tokens)
if ARGV[3] == '1' and tokens > 0 and redis.call('HINCRBY', KEYS[3], sec, -tokens) <= 0 then
  redis.call('HDEL', KEYS[3], sec)
end
return 1
""")


@dataclass
class Refusal:
    """Which shared bound refused the request: ``reason`` (queue_full, concurrency, tokens, overloaded), the count
    it reached across the gateways, and the seconds until it may pass."""

    reason: str
    count: int
    retry_after_s: int


class QuotaStore:
    """The shared side of admission for one gateway instance."""

    def __init__(self, redis, prefix: str, gateway: str, *, max_inflight: int, timeout_s: float,
                 lease_ms: int = LEASE_MS) -> None:
        self.redis, self.gateway, self.max_inflight, self.timeout_s = redis, gateway, max_inflight, timeout_s
        self.lease_ms = lease_ms
        self._base = f"{prefix}{{quota}}:"
        self.k_gateways, self.k_total = f"{self._base}gateways", f"{self._base}inflight"
        self.k_held = f"{self._base}held:{gateway}"
        self._tasks: set[asyncio.Task] = set()
        self.alone = False  # the last renewal found no other live gateway (until then: assume there are others)
        self._renewals = self._renewed = 0

    def _tenant_keys(self, tenant: str, rid: str) -> list[str]:
        b = self._base
        return [f"{b}inflight:{tenant}", f"{b}tokens:{tenant}", self.k_held, f"{b}gone:{rid}"]

    async def admit(self, tenant: TenantConfig, rid: str, tokens: int) -> Refusal | None:
        """Count request ``rid`` if every shared bound allows it; a :class:`Refusal` if one does not. Raises a
        Redis error or TimeoutError: then :meth:`release` it (the script may still run).

        While this gateway is the only live one (its last lease renewal said so), its own counts are the whole
        counts: the local checks have decided, and the request is counted in Redis in the background, without a
        round trip on the request's path (another replica that starts sees it; until this gateway learns of that
        replica, at most one renewal interval, the two may admit a little past a bound together)."""
        q = tenant.quota
        tk, tok, held, gone = self._tenant_keys(tenant.name, rid)
        keys = [self.k_gateways, self.k_total, tk, tok, held, gone]
        args = [self.gateway, rid, tenant.name, tokens, tenant.max_queue, q.max_concurrency or 0,
                q.tokens_per_min or 0, self.max_inflight, self.lease_ms, WINDOW_S, "1" if self.alone else "0"]
        call = run_pipeline(self.redis, lambda p: ADMIT.queue(p, keys, args), scripts=[ADMIT])
        if self.alone:
            self._background(call, "quota_count_failed", rid)
            return None
        reply = (await asyncio.wait_for(call, timeout=self.timeout_s))[0]
        reason = _s(reply[0])
        return None if reason == "ok" else Refusal(reason, int(reply[1]), int(reply[2]))

    def _background(self, call, event: str, rid: str) -> None:
        async def run() -> None:
            try:
                await asyncio.wait_for(call, timeout=self.timeout_s)
            except (asyncio.TimeoutError, *REDIS_ERRORS) as e:
                log.debug(event, request_id=rid, error=repr(e))

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def release(self, tenant: str, rid: str, *, refund: bool = False) -> None:
        """Uncount request ``rid`` (``refund``: give its tokens back to the quota), in the background and retried
        while Redis is unreachable; idempotent, and safe before the admission it undoes has reached Redis."""
        tk, tok, held, gone = self._tenant_keys(tenant, rid)
        keys = [self.k_total, tk, tok, held, gone]
        args = [self.gateway, rid, 1 if refund else 0, GONE_MS]

        async def send() -> None:
            deadline, delay = asyncio.get_running_loop().time() + RELEASE_RETRY_S, 0.1
            while True:
                try:
                    await asyncio.wait_for(run_pipeline(self.redis, lambda p: RELEASE.queue(p, keys, args),
                                                        scripts=[RELEASE]), timeout=self.timeout_s)
                    return
                except (asyncio.TimeoutError, *REDIS_ERRORS) as e:
                    if asyncio.get_running_loop().time() > deadline:
                        log.warning("quota_release_failed", tenant=tenant, request_id=rid, error=repr(e))
                        return
                    await asyncio.sleep(delay)
                    delay = min(2.0, delay * 2)

        task = asyncio.get_running_loop().create_task(send())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def renew(self, *, leave: bool = False) -> None:
        """Extend this gateway's lease (``leave``: end it now, so its counts stop counting at once)."""
        if leave:
            await asyncio.wait_for(self.redis.zrem(self.k_gateways, self.gateway), timeout=self.timeout_s)
            return
        # the lease is set from the server's clock inside a script, as admissions do; it returns the live gateways
        self._renewals += 1
        seq = self._renewals
        live = (await asyncio.wait_for(run_pipeline(self.redis, lambda p: _RENEW.queue(
            p, [self.k_gateways], [self.gateway, self.lease_ms]), scripts=[_RENEW]), timeout=self.timeout_s))[0]
        if seq > self._renewed:  # a slower, older renewal must not overwrite a newer answer
            self._renewed = seq
            self.alone = int(live) == 1

    async def renew_loop(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await self.renew()
            except (asyncio.TimeoutError, *REDIS_ERRORS) as e:
                self.alone = False  # no news of the others: check with them on every admission
                log.debug("quota_renew_failed", error=repr(e))
            try:
                await asyncio.wait_for(stop.wait(), timeout=RENEW_S)
            except asyncio.TimeoutError:
                pass

    async def leave(self) -> None:
        """At shutdown: let pending releases land (briefly), then end the lease (best effort)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.timeout_s)
        try:
            await self.renew(leave=True)
        except (asyncio.TimeoutError, *REDIS_ERRORS):
            pass


_RENEW = LuaScript("""
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now_ms)
redis.call('ZADD', KEYS[1], now_ms + tonumber(ARGV[2]), ARGV[1])
return redis.call('ZCARD', KEYS[1])
""")


def _s(v) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)
