"""Lua scripts of the GMG store. Each one checks, applies, bumps the epoch and appends one change-stream entry
(see :mod:`shared.gmg.mutations`) atomically, so a change is either fully visible with its epoch or not at all.
"""
from __future__ import annotations

from shared.gmg.mutations import LUA_APPLY_ONE

# Shared prologue: guards are [key_index, field, accepted...]; '' accepts a missing field, '*' any present value.
_GUARDS = """
local function check_guards(guards)
  for _, g in ipairs(guards) do
    local v = redis.call('HGET', KEYS[g[1]], g[2])
    local ok = false
    for j = 3, #g do
      if (g[j] == '' and not v) or (g[j] == '*' and v) or (v and v == g[j]) then ok = true end
    end
    if not ok then return {0, 'conflict', g[2], v or ''} end
  end
  return nil
end
local function finish(op, log, fields_extra)
  local fields = {'op', op, 'epoch', '0', 'k', cmsgpack.pack(KEYS), 'm', cmsgpack.pack(log)}
  for _, v in ipairs(fields_extra) do fields[#fields + 1] = v end
  local epoch = redis.call('INCR', KEYS[1])
  fields[4] = tostring(epoch)
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(fields))
  return epoch
end
"""

# KEYS: epoch, changes, others...
# ARGV: op, packed {items, guards, muts, now}, maxlen, blobs...
#   item: [mode ('new'|'resize'), device_key_index, reservations_key_index, owner, kind, tenant, bytes, device_id]
#   'new' adds a reservation of ``bytes``; 'resize' sets an existing one to ``bytes`` (grow or shrink).
# Refuses (nothing changed) unless, on every device, reserved + growth <= limit.
COMMIT = LUA_APPLY_ONE + _GUARDS + """
local spec = cmsgpack.unpack(ARGV[2])
local items, guards, muts, now = spec[1], spec[2], spec[3], spec[4]
local bad = check_guards(guards)
if bad then return bad end
local need, order, seen, deltas, kt = {}, {}, {}, {}, {}
for i, it in ipairs(items) do
  local mode, dk, rk, owner, nbytes, dev = it[1], KEYS[it[2]], KEYS[it[3]], it[4], tonumber(it[7]), it[8]
  if redis.call('EXISTS', dk) == 0 then return {0, 'unknown_device', dev, ''} end
  if seen[rk .. '\\0' .. owner] then return {0, 'duplicate', dev, owner} end
  seen[rk .. '\\0' .. owner] = true
  local cur = redis.call('HGET', rk, owner)
  local delta
  if mode == 'new' then
    if cur then return {0, 'duplicate', dev, owner} end
    delta = nbytes
    kt[i] = it[5] .. '|' .. it[6]
  else
    if not cur then return {0, 'unknown_owner', dev, owner} end
    local k, t, b = string.match(cur, '^([^|]*)|([^|]*)|([^|]*)')
    delta = nbytes - tonumber(b)
    kt[i] = k .. '|' .. t
  end
  deltas[i] = delta
  if not need[dk] then need[dk] = 0; order[#order + 1] = {dk, dev} end
  need[dk] = need[dk] + delta
end
for _, o in ipairs(order) do
  local dk = o[1]
  if need[dk] > 0 then
    local limit = tonumber(redis.call('HGET', dk, 'limit') or '0')
    local reserved = tonumber(redis.call('HGET', dk, 'reserved') or '0')
    if reserved + need[dk] > limit then
      return {0, 'insufficient_memory', o[2], string.format('%d', limit - reserved)}
    end
  end
end
local log = {}
for i, it in ipairs(items) do
  local d = string.format('%d', deltas[i])
  local v = kt[i] .. '|' .. string.format('%d', tonumber(it[7])) .. '|' .. now
  redis.call('HINCRBY', KEYS[it[2]], 'reserved', d)
  redis.call('HSET', KEYS[it[3]], it[4], v)
  log[#log + 1] = {'hincrby', it[2], 'reserved', d}
  log[#log + 1] = {'hset', it[3], it[4], v}
end
local extra = {}
for _, m in ipairs(muts) do
  apply_one(m, KEYS[m[2]])
  log[#log + 1] = m
  if m[1] == 'setblob' then
    extra[#extra + 1] = 'x' .. m[3]
    extra[#extra + 1] = ARGV[tonumber(m[3])]
  end
end
local epoch = finish(ARGV[1], log, extra)
return {1, 'ok', tostring(epoch), ''}
"""

# KEYS: epoch, changes, others...
# ARGV: op, packed {items, guards, muts}, maxlen
#   item: [device_key_index, reservations_key_index, owner]; a missing owner releases nothing (idempotent).
# Returns {1, freed_bytes, epoch} or {1, 0, 0} when nothing changed, or a guard conflict.
RELEASE = LUA_APPLY_ONE + _GUARDS + """
local spec = cmsgpack.unpack(ARGV[2])
local items, guards, muts = spec[1], spec[2], spec[3]
local bad = check_guards(guards)
if bad then return bad end
local log, freed = {}, 0
for _, it in ipairs(items) do
  local v = redis.call('HGET', KEYS[it[2]], it[3])
  if v then
    local b = tonumber(string.match(v, '^[^|]*|[^|]*|([^|]*)'))
    local d = string.format('%d', -b)
    redis.call('HDEL', KEYS[it[2]], it[3])
    redis.call('HINCRBY', KEYS[it[1]], 'reserved', d)
    log[#log + 1] = {'hdel', it[2], it[3]}
    log[#log + 1] = {'hincrby', it[1], 'reserved', d}
    freed = freed + b
  end
end
for _, m in ipairs(muts) do
  apply_one(m, KEYS[m[2]])
  log[#log + 1] = m
end
if #log == 0 then return {1, '0', '0', ''} end
local epoch = finish(ARGV[1], log, {})
return {1, string.format('%d', freed), tostring(epoch), ''}
"""
