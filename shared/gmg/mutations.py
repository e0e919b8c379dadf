"""GMG writes as a replayable log of deterministic key commands.

Every GMG write runs in one Lua script that applies a list of mutations, bumps the epoch and appends one entry to
the change stream carrying the same mutations. A follower that holds a copy of the GMG keys at epoch ``e`` and
replays the entry of epoch ``e + 1`` holds the copy at ``e + 1`` (the commands are deterministic), so it can rebuild
the whole GMG from a snapshot plus the stream.

Change-stream entry fields: ``op`` (what happened, e.g. ``heartbeat``, ``reserve``, ``lease_commit``), ``epoch``,
``k`` (msgpack list of the full key names the mutations refer to by 1-based index), ``m`` (msgpack list of
mutations ``[cmd, key_index, *args]``), and ``x<n>`` for binary values referenced by ``setblob``.
"""
from __future__ import annotations

from typing import Any

import msgspec

# Commands a mutation may use, with the same semantics in Lua (Redis) and in :func:`apply_mutation` (a mirror).
COMMANDS = ("hset", "hdel", "hincrby", "del", "set", "setblob", "sadd", "srem", "zadd", "zrem", "zremrangebyscore")

# Lua helper shared by every script: apply one mutation ``m`` whose key is ``key``. ``blob`` resolves setblob.
LUA_APPLY_ONE = """
local function apply_one(m, key)
  local cmd = m[1]
  local a = {}
  for j = 3, #m do a[#a + 1] = m[j] end
  if cmd == 'hset' then redis.call('HSET', key, unpack(a))
  elseif cmd == 'hdel' then redis.call('HDEL', key, unpack(a))
  elseif cmd == 'hincrby' then redis.call('HINCRBY', key, a[1], a[2])
  elseif cmd == 'del' then redis.call('DEL', key)
  elseif cmd == 'set' then redis.call('SET', key, a[1])
  elseif cmd == 'setblob' then redis.call('SET', key, ARGV[tonumber(a[1])])
  elseif cmd == 'sadd' then redis.call('SADD', key, unpack(a))
  elseif cmd == 'srem' then redis.call('SREM', key, unpack(a))
  elseif cmd == 'zadd' then redis.call('ZADD', key, unpack(a))
  elseif cmd == 'zrem' then redis.call('ZREM', key, unpack(a))
  elseif cmd == 'zremrangebyscore' then redis.call('ZREMRANGEBYSCORE', key, a[1], a[2])
  else error('unknown mutation ' .. tostring(cmd)) end
end
"""

# KEYS: epoch, changes, targets...; ARGV: op, packed mutations, maxlen, blobs...
APPLY_SCRIPT = LUA_APPLY_ONE + """
local muts = cmsgpack.unpack(ARGV[2])
local fields = {'op', ARGV[1], 'epoch', '0', 'k', cmsgpack.pack(KEYS), 'm', ARGV[2]}
for _, m in ipairs(muts) do
  apply_one(m, KEYS[m[2]])
  if m[1] == 'setblob' then
    fields[#fields + 1] = 'x' .. m[3]
    fields[#fields + 1] = ARGV[tonumber(m[3])]
  end
end
local epoch = redis.call('INCR', KEYS[1])
fields[4] = tostring(epoch)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(fields))
return epoch
"""


class MutationBatch:
    """Collects mutations for one atomic GMG write; keys are given by full name and indexed for the script."""

    def __init__(self, epoch_key: str, changes_key: str) -> None:
        self.keys: list[str] = [epoch_key, changes_key]
        self._index: dict[str, int] = {}
        self.muts: list[list[Any]] = []
        self.blobs: list[bytes] = []

    def key_index(self, key: str) -> int:
        """1-based index of ``key`` in the batch's KEYS (added on first use)."""
        i = self._index.get(key)
        if i is None:
            self.keys.append(key)
            i = self._index[key] = len(self.keys)  # 1-based, as Lua's KEYS
        return i

    def add(self, cmd: str, key: str, *args: Any) -> "MutationBatch":
        if cmd not in COMMANDS:
            raise ValueError(f"unknown mutation command {cmd!r}")
        self.muts.append([cmd, self.key_index(key), *(_str(a) for a in args)])
        return self

    def hset(self, key: str, mapping: dict[str, Any]) -> "MutationBatch":
        if mapping:
            flat: list[Any] = []
            for k, v in mapping.items():
                flat += [k, v]
            self.add("hset", key, *flat)
        return self

    def setblob(self, key: str, data: bytes) -> "MutationBatch":
        self.blobs.append(bytes(data))
        self.muts.append(["setblob", self.key_index(key), str(3 + len(self.blobs))])  # ARGV index of the blob
        return self

    def __len__(self) -> int:
        return len(self.muts)

    def script_args(self, op: str, maxlen: int) -> tuple[list[str], list[Any]]:
        """KEYS and ARGV for :data:`APPLY_SCRIPT`."""
        return self.keys, [op, msgspec.msgpack.encode(self.muts), maxlen, *self.blobs]


def _str(v: Any) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, int):
        return str(v)
    raise TypeError(f"mutation argument must be str/int/float/bool, got {type(v).__name__}")


# ---------------------------------------------------------------- the mirror side (followers)
Mirror = dict[str, Any]  # key -> dict (hash) | set | dict member->score (zset, under ZSET tag) | str | bytes


class ZSet(dict):
    """A sorted set in a mirror: member -> score."""


def decode_change(fields: dict) -> tuple[int, str, list[tuple[str, str, list[Any]]]]:
    """(epoch, op, [(cmd, key, args)]) of one change-stream entry; ``setblob`` args become the blob bytes."""
    f = {(k.decode() if isinstance(k, bytes) else k): v for k, v in fields.items()}
    keys = msgspec.msgpack.decode(f["k"])
    muts = msgspec.msgpack.decode(f["m"])
    out = []
    for m in muts:
        cmd, key, args = m[0], keys[int(m[1]) - 1], list(m[2:])
        if cmd == "setblob":
            args = [f[f"x{args[0]}"]]
        out.append((cmd, key, args))
    op = f["op"].decode() if isinstance(f["op"], bytes) else f["op"]
    return int(f["epoch"]), op, out


def apply_mutation(mirror: Mirror, cmd: str, key: str, args: list[Any]) -> None:
    """Apply one mutation to a mirror exactly as Redis applies it to the real keys."""
    if cmd == "hset":
        h = mirror.setdefault(key, {})
        for i in range(0, len(args), 2):
            h[args[i]] = args[i + 1]
    elif cmd == "hdel":
        h = mirror.get(key)
        if h:
            for f in args:
                h.pop(f, None)
            if not h:
                del mirror[key]
    elif cmd == "hincrby":
        h = mirror.setdefault(key, {})
        h[args[0]] = str(int(h.get(args[0], "0")) + int(args[1]))
    elif cmd == "del":
        mirror.pop(key, None)
    elif cmd in ("set", "setblob"):
        mirror[key] = args[0]
    elif cmd == "sadd":
        mirror.setdefault(key, set()).update(args)
    elif cmd == "srem":
        s = mirror.get(key)
        if s:
            s.difference_update(args)
            if not s:
                del mirror[key]
    elif cmd == "zadd":
        z = mirror.setdefault(key, ZSet())
        for i in range(0, len(args), 2):
            z[args[i + 1]] = float(args[i])
    elif cmd == "zrem":
        z = mirror.get(key)
        if z:
            for m in args:
                z.pop(m, None)
            if not z:
                del mirror[key]
    elif cmd == "zremrangebyscore":
        z = mirror.get(key)
        if z:
            lo, hi = _score(args[0]), _score(args[1])
            for m in [m for m, s in z.items() if lo <= s <= hi]:
                del z[m]
            if not z:
                del mirror[key]
    else:
        raise ValueError(f"unknown mutation command {cmd!r}")


def _score(s: str) -> float:
    return float(s.lstrip("+"))  # "-inf", "+inf" and plain numbers, as ZREMRANGEBYSCORE takes them
