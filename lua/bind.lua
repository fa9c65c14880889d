#!lua
-- name: bind
-- version: 4
-- summary: Add or refresh bindings in an exchange's binding table, scored with the unix time at which each goes stale.
-- KEYS: 1
--   table    ZSET    P binding:<exchange>           member routing_key SEP pattern SEP queue -> stale-at unix ms (+inf: never)
-- ARGV:
--   1   lifetime_ms  integer 1..315360000000 or ''   how long the binding lives without a refresh; '' means forever (+inf)
--   2.. member       string              routing_key .. sep .. pattern .. sep .. queue, as kombu encodes it
-- returns: integer, how many members were new
-- errors:
--   ERR celery-redis-lua: bind: expected 1 key (binding table), got N
--   ERR celery-redis-lua: bind: expected a lifetime and at least one member
--   ERR celery-redis-lua: bind: lifetime_ms must be an integer in 1..315360000000 or empty, got 'V'
-- why: bindings of queues that expire must expire too, or producers would keep routing to
--   a queue nobody consumes. A consumer of the queue refreshes its bindings well within
--   their lifetime; the caller chooses the lifetime (the transport gives an expiring
--   queue's bindings max(x-expires, binding_lifetime_floor), 300 s by default, so a slow
--   refresh never drops a live route). The table key itself gets a TTL at its stalest
--   member's time, unless some member lives forever.
--   lifetime_ms is at most 10 years (315360000000 ms): now plus it stays an exact double.

local rcall = redis.call
local MAX_DURATION_MS = 315360000000 -- 10 years in ms, the longest duration taken or read back (bounds.py)

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: bind: ' .. message)
end

if #KEYS ~= 1 then return fail('expected 1 key (binding table), got ' .. #KEYS) end
if #ARGV < 2 then return fail('expected a lifetime and at least one member') end
local lifetime = ARGV[1] ~= '' and string.match(ARGV[1], '^%d+$') and tonumber(ARGV[1])
if ARGV[1] ~= '' and (not lifetime or lifetime == 0 or lifetime > MAX_DURATION_MS) then
  return fail("lifetime_ms must be an integer in 1.." .. string.format('%d', MAX_DURATION_MS) .. " or empty, got '" ..
              ARGV[1] .. "'")
end

local score = '+inf'
if lifetime then
  local time = rcall('TIME')
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  score = string.format('%d', now + lifetime)
end

local added = 0
for i = 2, #ARGV do
  added = added + rcall('ZADD', KEYS[1], score, ARGV[i])
end

local last = rcall('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')
if last[2] == 'inf' then
  rcall('PERSIST', KEYS[1])
else
  rcall('PEXPIREAT', KEYS[1], last[2])
end
return added
