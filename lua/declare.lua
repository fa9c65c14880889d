#!lua
-- name: declare
-- version: 1
-- summary: Declare a queue: store its arguments (RabbitMQ's x-expires, x-message-ttl, x-max-priority) and refresh its expiry.
-- KEYS: 4
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments and the id sequence; it is what makes a queue exist
-- ARGV:
--   1  expires_ms      integer > 0 or ''      the queue's keys expire after this long without a publish, declare or extend; floor 10000
--   2  message_ttl_ms  integer > 0 or ''      messages expire after this long in the queue (per-message TTLs can only shorten it)
--   3  max_priority    integer 0..255 or ''   priorities above it are delivered as it
-- returns: array {ready, delayed, in_flight} message counts (in_flight is approximate: index entries minus ready)
-- errors:
--   ERR celery-redis-lua: declare: expected 4 keys (queue, delayed, index, meta), got N
--   ERR celery-redis-lua: declare: expected 3 arguments, got N
--   ERR celery-redis-lua: declare: expires_ms must be a positive integer or empty, got 'V'
--   ERR celery-redis-lua: declare: message_ttl_ms must be a positive integer or empty, got 'V'
--   ERR celery-redis-lua: declare: max_priority must be an integer in 0..255 or empty, got 'V'
-- why: arguments live in the broker, as with RabbitMQ, so that producers in any language
--   get the same TTL and priority cap without knowing them. An argument given as '' is
--   removed: the last declaration wins. Without expires the queue's keys are persisted.

local rcall = redis.call
local MIN_EXPIRES_MS = 10000

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: declare: ' .. message)
end

local function optional(value, name, low, high, what)
  if value == '' then return false end
  local n = string.match(value, '^%d+$') and tonumber(value)
  if not n or n < low or (high and n > high) then
    return nil, name .. ' must be ' .. what .. ' or empty, got \'' .. value .. "'"
  end
  return n
end

if #KEYS ~= 4 then return fail('expected 4 keys (queue, delayed, index, meta), got ' .. #KEYS) end
if #ARGV ~= 3 then return fail('expected 3 arguments, got ' .. #ARGV) end
local expires, err1 = optional(ARGV[1], 'expires_ms', 1, nil, 'a positive integer')
if expires == nil then return fail(err1) end
local ttl, err2 = optional(ARGV[2], 'message_ttl_ms', 1, nil, 'a positive integer')
if ttl == nil then return fail(err2) end
local max_priority, err3 = optional(ARGV[3], 'max_priority', 0, 255, 'an integer in 0..255')
if max_priority == nil then return fail(err3) end

local meta_key = KEYS[4]
rcall('HINCRBY', meta_key, 'seq', 0) -- the queue exists from now on, even while empty
local fields = {expires = expires and math.max(expires, MIN_EXPIRES_MS), message_ttl = ttl,
                max_priority = max_priority}
for _, name in ipairs({'expires', 'message_ttl', 'max_priority'}) do
  if fields[name] then
    rcall('HSET', meta_key, name, fields[name])
  else
    rcall('HDEL', meta_key, name)
  end
end
for i = 1, 4 do
  if fields.expires then rcall('PEXPIRE', KEYS[i], fields.expires) else rcall('PERSIST', KEYS[i]) end
end

local ready = rcall('ZCARD', KEYS[1]) - rcall('ZCOUNT', KEYS[1], '2560000000000000', '+inf')
return {ready, rcall('ZCARD', KEYS[2]), math.max(0, rcall('ZCARD', KEYS[3]) - ready)}
