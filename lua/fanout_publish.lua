#!lua
-- name: fanout_publish
-- version: 3
-- summary: Append a message to a fanout exchange's stream, trimmed to about maxlen entries.
-- KEYS: 2
--   stream   STREAM  P /<db>.<exchange>            fanout messages; entry fields 'payload', 'routing_key'
--   groups   HASH    {P /<db>.<exchange>}:groups   bound queue -> 'ACTIVE_AT EXPIRES TTL' (expiry refresh only)
-- ARGV:
--   1  payload     string, non-empty     the kombu envelope, stored unchanged
--   2  maxlen      integer >= 1          approximate cap (XADD MAXLEN ~)
--   3  expires_ms  integer 1..315360000000 or ''  the stream expires after this long without a publish, bind or read; '' means never
--   4  routing_key string                the routing key it was published with (may be empty)
-- returns: bulk string, the stream entry id
-- errors:
--   ERR celery-redis-lua: fanout_publish: expected 2 keys (stream, groups), got N
--   ERR celery-redis-lua: fanout_publish: expected 4 arguments, got N
--   ERR celery-redis-lua: fanout_publish: payload is missing or empty
--   ERR celery-redis-lua: fanout_publish: maxlen must be a positive integer, got 'V'
--   ERR celery-redis-lua: fanout_publish: expires_ms must be an integer in 1..315360000000 or empty, got 'V'
-- why: '~' lets the server trim whole radix-tree nodes, which is far cheaper than an
--   exact cap; the stream may hold slightly more than maxlen entries. The entry id's
--   first part is the server's unix ms: consumers measure a message's age by it.
--   expires_ms is at most 10 years (315360000000 ms): now plus it stays an exact double.

local rcall = redis.call
local MAX_DURATION_MS = 315360000000 -- 10 years in ms, the longest duration taken or read back (bounds.py)

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: fanout_publish: ' .. message)
end

if #KEYS ~= 2 then return fail('expected 2 keys (stream, groups), got ' .. #KEYS) end
if #ARGV ~= 4 then return fail('expected 4 arguments, got ' .. #ARGV) end
if ARGV[1] == '' then return fail('payload is missing or empty') end
local maxlen = string.match(ARGV[2], '^%d+$') and tonumber(ARGV[2])
if not maxlen or maxlen < 1 then return fail("maxlen must be a positive integer, got '" .. ARGV[2] .. "'") end
local expires = ARGV[3] ~= '' and string.match(ARGV[3], '^%d+$') and tonumber(ARGV[3])
if ARGV[3] ~= '' and (not expires or expires == 0 or expires > MAX_DURATION_MS) then
  return fail("expires_ms must be an integer in 1.." .. string.format('%d', MAX_DURATION_MS) .. " or empty, got '" ..
              ARGV[3] .. "'")
end

local id = rcall('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', 'payload', ARGV[1], 'routing_key', ARGV[4])
if expires then
  local time = rcall('TIME')
  local at = string.format('%d', tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + expires)
  rcall('PEXPIREAT', KEYS[1], at) -- one absolute time: the stream and its groups expire together
  rcall('PEXPIREAT', KEYS[2], at)
end
return id
