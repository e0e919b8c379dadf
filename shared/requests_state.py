"""Per-request journey in Redis: ``{prefix}req:{request_id}`` hash, written by the scheduler and workers.

Fields: tenant, gateway, state (queued|assigned|running|done|failed|cancelled|rejected), device, kv_blocks,
attempt, worker_id, and ``*_ts`` timestamps per transition. The move to a terminal state goes through
:class:`TerminalFence`, so each request gets exactly one terminal result. Terminal requests expire after ``TERMINAL_TTL_S`` so
``slicesched inspect request`` can show recent journeys.
"""
from __future__ import annotations

import time

from shared.redis_util import LuaScript, run_pipeline

TERMINAL_STATES = frozenset({"done", "failed", "cancelled", "rejected"})
TERMINAL_TTL_S = 3600


def req_key(prefix: str, request_id: str) -> str:
    return f"{prefix}req:{request_id}"


def assigned_key(prefix: str, device: str) -> str:
    """Set of request ids the scheduler has placed on ``device`` and not yet seen finish."""
    return f"{prefix}sched:assigned:{device}"


def tenant_stats_key(prefix: str, tenant: str) -> str:
    """Hash the scheduler keeps per tenant: queued, running, admitted, rejected, ts (read by gateway, inspect)."""
    return f"{prefix}sched:tenant:{tenant}"


# Exactly one terminal result per request: whoever ends a request (the worker with its final chunk or error, the
# scheduler failing a dead worker's requests, a deadline or a poison entry) first moves its hash to a terminal
# state with this script and only then writes the result; a loser writes nothing. Claiming again is idempotent for
# the same claimant and state (a retried publish). One key, so it also works on Redis Cluster. A missing hash
# (expired, or lost with Redis) does not fence: it is created with the terminal state.
# KEYS[1] req hash; ARGV: state, ts, owner (worker id that must own the request, or ''), ttl, claimant
CLAIM_TERMINAL = """
local st = redis.call('HGET', KEYS[1], 'state')
if st == 'done' or st == 'failed' or st == 'cancelled' or st == 'rejected' then
  if st == ARGV[1] and redis.call('HGET', KEYS[1], 'ended_by') == ARGV[5] then return 1 end
  return 0
end
if ARGV[3] ~= '' then
  local owner = redis.call('HGET', KEYS[1], 'worker_id')
  if owner and owner ~= '' and owner ~= ARGV[3] then return 0 end
end
redis.call('HSET', KEYS[1], 'state', ARGV[1], ARGV[1] .. '_ts', ARGV[2], 'ended_by', ARGV[5])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return 1
"""

_CLAIM = LuaScript(CLAIM_TERMINAL)


class TerminalFence:
    """Claims the single terminal transition of requests for one claimant (a worker instance or the scheduler).

    ``owner``: the worker instance that must own the request (workers pass their own id; the scheduler passes '').
    """

    def __init__(self, redis, prefix: str, claimant: str, *, owner: str = "") -> None:
        self.redis, self.prefix, self.claimant, self.owner = redis, prefix, claimant, owner

    async def claim(self, request_id: str, state: str) -> bool:
        """True if this claimant ended the request (it may now publish the result); False if it was fenced."""
        return (await self.claim_many([(request_id, state)]))[0]

    async def claim_many(self, items: list[tuple[str, str]]) -> list[bool]:
        """:meth:`claim` for several ``(request_id, state)`` pairs in one round trip."""
        if not items:
            return []
        bad = [s for _, s in items if s not in TERMINAL_STATES]
        if bad:
            raise ValueError(f"not terminal states: {bad}")
        now = f"{time.time():.6f}"
        keys = [req_key(self.prefix, rid) for rid, _ in items]

        def build(pipe) -> None:
            for key, (_, state) in zip(keys, items):  # one key each: on a cluster they spread over the masters
                _CLAIM.queue(pipe, [key], [state, now, self.owner, TERMINAL_TTL_S, self.claimant])

        # a claim decides who publishes the result: it must survive a failover of its master (WAIT)
        replies = await run_pipeline(self.redis, build, scripts=[_CLAIM], replicate=keys)
        return [bool(int(x)) for x in replies]


# A guest lane's hand-off of a running request to a home worker (services/worker/handoff.py): the guest marks the
# hash with a token while it owns the request; the home takes it over only while the token is there; the guest
# gives up by clearing the token. Whichever script runs first decides, so exactly one worker continues it.
# KEYS[1] req hash. begin ARGV: worker id (must own it), token
HANDOFF_BEGIN = """
local st = redis.call('HGET', KEYS[1], 'state')
if st ~= 'running' or redis.call('HGET', KEYS[1], 'worker_id') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'handoff', ARGV[2])
return 1
"""
# commit ARGV: token, new worker id, new device, ts
HANDOFF_COMMIT = """
if redis.call('HGET', KEYS[1], 'state') ~= 'running' or redis.call('HGET', KEYS[1], 'handoff') ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'worker_id', ARGV[2], 'device', ARGV[3], 'moved_ts', ARGV[4])
redis.call('HDEL', KEYS[1], 'handoff')
return 1
"""
# abort ARGV: token
HANDOFF_ABORT = """
if redis.call('HGET', KEYS[1], 'handoff') ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], 'handoff')
return 1
"""
_HANDOFF = {"begin": LuaScript(HANDOFF_BEGIN), "commit": LuaScript(HANDOFF_COMMIT), "abort": LuaScript(HANDOFF_ABORT)}


async def handoff_step(redis, prefix: str, request_id: str, step: str, *args) -> bool:
    """Run one step of the hand-off protocol (``begin`` worker_id token | ``commit`` token worker_id device ts |
    ``abort`` token) on the request's hash; True if it took effect."""
    script = _HANDOFF[step]
    key = req_key(prefix, request_id)
    replies = await run_pipeline(redis, lambda pipe: script.queue(pipe, [key], list(args)), scripts=[script],
                                 replicate=[key])
    return bool(int(replies[0]))
