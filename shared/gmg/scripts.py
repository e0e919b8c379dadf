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

# Making room (COMMIT's rooms): on a device where the items do not fit, pick weights staged there that the commit
# may evict: ``weights:{tenant}:{segment}`` reservations the commit does not itself touch, whose segment is resident,
# whose tenant is neither the device's home tenant nor in ``keep``, and that no active lease pins; least recently
# leased first (``recency``: "tenant|segment" -> time, unknown = 0; ties in the reservations hash's order) until
# ``short`` bytes are free. Returns nil (evict nothing) when all of them together would not free ``short``.
# (It walks the device's reservations, not its residency: a home's residency lists every segment of its tenant.)
#   room: [device_key_index, resident_key_index, pins_key_index, reservations_key_index, keep, recency, device_id]
_ROOM = """
local function pick_victims(r, short, seen)
  local resk, pk, rk = KEYS[r[2]], KEYS[r[3]], KEYS[r[4]]
  local skip = {}
  for _, t in ipairs(r[5]) do skip[t] = true end
  local home = redis.call('HGET', KEYS[r[1]], 'home_tenant')
  if home and home ~= '' then skip[home] = true end
  local recency = r[6]
  local all = redis.call('HGETALL', rk)
  local cands, total = {}, 0
  for i = 1, #all, 2 do
    local owner = all[i]
    if string.sub(owner, 1, 8) == 'weights:' and not seen[rk .. '\\0' .. owner] then
      local kind, tenant, b = string.match(all[i + 1], '^([^|]*)|([^|]*)|([^|]*)')
      local prefix = 'weights:' .. tenant .. ':'
      if kind == 'weights' and not skip[tenant] and string.sub(owner, 1, #prefix) == prefix then
        local seg = string.sub(owner, #prefix + 1)
        local field = tenant .. '|' .. seg
        if redis.call('HEXISTS', resk, field) == 1 and (tonumber(redis.call('HGET', pk, field)) or 0) <= 0 then
          b = tonumber(b)
          cands[#cands + 1] = {r, field, owner, b, tonumber(recency[field]) or 0, i, tenant, seg}
          total = total + b
        end
      end
    end
  end
  if total < short then return nil end
  table.sort(cands, function(x, y) if x[5] ~= y[5] then return x[5] < y[5] end return x[6] < y[6] end)
  local out, freed = {}, 0
  for _, c in ipairs(cands) do
    if freed >= short then break end
    out[#out + 1] = c
    freed = freed + c[4]
  end
  return out
end
"""

# KEYS: epoch, changes, others...
# ARGV: op, packed {items, guards, muts, now, rooms}, maxlen, blobs...
#   item: [mode ('new'|'resize'), device_key_index, reservations_key_index, owner, kind, tenant, bytes, device_id]
#   'new' adds a reservation of ``bytes``; 'resize' sets an existing one to ``bytes`` (grow or shrink).
#   rooms (optional): devices where the commit may evict cached staged weights to fit (see _ROOM).
# Refuses (nothing changed) unless, on every device, reserved + growth <= limit once the victims picked on the
# devices with a room are freed. Returns {1, 'ok', epoch, packed [[device_id, tenant, segment, bytes], ...] evicted
# or ''} or {0, reason, device/field, detail}.
COMMIT = LUA_APPLY_ONE + _GUARDS + _ROOM + """
local spec = cmsgpack.unpack(ARGV[2])
local items, guards, muts, now, rooms = spec[1], spec[2], spec[3], spec[4], spec[5] or {}
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
local room = {}
for _, r in ipairs(rooms) do room[KEYS[r[1]]] = r end
local victims = {}
for _, o in ipairs(order) do
  local dk = o[1]
  if need[dk] > 0 then
    local limit = tonumber(redis.call('HGET', dk, 'limit') or '0')
    local reserved = tonumber(redis.call('HGET', dk, 'reserved') or '0')
    if reserved + need[dk] > limit then
      local picked = room[dk] and pick_victims(room[dk], reserved + need[dk] - limit, seen)
      if not picked then
        return {0, 'insufficient_memory', o[2], string.format('%d', limit - reserved)}
      end
      for _, c in ipairs(picked) do victims[#victims + 1] = c end
    end
  end
end
local log, evicted = {}, {}
for _, c in ipairs(victims) do
  local r, d = c[1], string.format('%d', -c[4])
  redis.call('HDEL', KEYS[r[2]], c[2])
  redis.call('HDEL', KEYS[r[3]], c[2])
  redis.call('HDEL', KEYS[r[4]], c[3])
  redis.call('HINCRBY', KEYS[r[1]], 'reserved', d)
  log[#log + 1] = {'hdel', r[2], c[2]}
  log[#log + 1] = {'hdel', r[3], c[2]}
  log[#log + 1] = {'hdel', r[4], c[3]}
  log[#log + 1] = {'hincrby', r[1], 'reserved', d}
  evicted[#evicted + 1] = {r[7], c[7], c[8], string.format('%d', c[4])}
end
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
return {1, 'ok', tostring(epoch), #evicted > 0 and cmsgpack.pack(evicted) or ''}
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
