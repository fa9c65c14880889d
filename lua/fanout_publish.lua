#!lua
-- name: fanout_publish
-- version: 1
-- summary: Append a message to a fanout exchange's stream, trimmed to about maxlen entries.
-- KEYS: 1
--   stream   STREAM  P /<db>.<exchange>   fanout messages; entry fields 'payload', 'routing_key'
-- ARGV:
--   1  payload     string, non-empty     the kombu envelope, stored unchanged
--   2  maxlen      integer >= 1          approximate cap (XADD MAXLEN ~)
--   3  expires_ms  integer > 0 or ''     the stream expires after this long without a publish; '' means never
--   4  routing_key string                the routing key it was published with (may be empty)
-- returns: bulk string, the stream entry id
-- errors:
--   ERR celery-redis-lua: fanout_publish: expected 1 key (stream), got N
--   ERR celery-redis-lua: fanout_publish: expected 4 arguments, got N
--   ERR celery-redis-lua: fanout_publish: payload is missing or empty
--   ERR celery-redis-lua: fanout_publish: maxlen must be a positive integer, got 'V'
--   ERR celery-redis-lua: fanout_publish: expires_ms must be a positive integer or empty, got 'V'
-- why: '~' lets the server trim whole radix-tree nodes, which is far cheaper than an
--   exact cap; the stream may hold slightly more than maxlen entries.

local rcall = redis.call

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: fanout_publish: ' .. message)
end

if #KEYS ~= 1 then return fail('expected 1 key (stream), got ' .. #KEYS) end
if #ARGV ~= 4 then return fail('expected 4 arguments, got ' .. #ARGV) end
if ARGV[1] == '' then return fail('payload is missing or empty') end
local maxlen = string.match(ARGV[2], '^%d+$') and tonumber(ARGV[2])
if not maxlen or maxlen < 1 then return fail("maxlen must be a positive integer, got '" .. ARGV[2] .. "'") end
local expires = ARGV[3] ~= '' and string.match(ARGV[3], '^%d+$') and tonumber(ARGV[3])
if ARGV[3] ~= '' and (not expires or expires == 0) then
  return fail("expires_ms must be a positive integer or empty, got '" .. ARGV[3] .. "'")
end

local id = rcall('XADD', KEYS[1], 'MAXLEN', '~', maxlen, '*', 'payload', ARGV[1], 'routing_key', ARGV[4])
if expires then rcall('PEXPIRE', KEYS[1], expires) end
return id
