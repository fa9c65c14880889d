#!lua
-- name: publish
-- version: 1
-- summary: Store one message in one queue: ready at once, or delayed until an absolute ETA.
-- KEYS: 4
--   queue    ZSET    P queue:{Q}           ready messages, score (255 - priority) * 10^13 + ready_at_ms
--   delayed  ZSET    P delayed:{Q}         delayed messages, score = ETA in unix ms
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments (expires, message_ttl, max_priority) and the id sequence
-- ARGV:
--   1  message_key_prefix  string             P message: ; the hash is prefix .. '{Q}:' .. id
--   2  payload             string, non-empty  the kombu envelope, stored unchanged
--   3  priority            integer 0..255     higher is delivered first; '' means 0; capped by the queue's max_priority
--   4  eta_ms              integer >= 0       absolute unix ms by the server's clock; '' or 0 means now
--   5  ttl_ms              integer > 0 or -1  message TTL in ms; '' or -1 means none; the queue's message_ttl wins when shorter
--   6  visibility_ms       integer > 0        how long a ready message may sit popped but unclaimed before the sweep restores it
-- returns: bulk string, the new message id (16 hex digits, a per-queue sequence)
-- errors:
--   ERR celery-redis-lua: publish: expected 4 keys (queue, delayed, index, meta), got N
--   ERR celery-redis-lua: publish: expected 6 arguments, got N
--   ERR celery-redis-lua: publish: key 'K' has no {hash tag}
--   ERR celery-redis-lua: publish: payload is missing or empty
--   ERR celery-redis-lua: publish: priority must be an integer in 0..255, got 'V'
--   ERR celery-redis-lua: publish: eta_ms must be an integer >= 0, got 'V'
--   ERR celery-redis-lua: publish: ttl_ms must be a positive integer or -1, got 'V'
--   ERR celery-redis-lua: publish: visibility_ms must be a positive integer, got 'V'
-- why: ids come from a per-queue sequence, zero-padded, so that messages with the
--   same priority and the same millisecond still come out in publish order (equal
--   ZSET scores fall back to member order). A ready message is indexed at once so
--   that a consumer dying between BZMPOP and claim cannot lose it. A delayed one
--   leaves a wake marker in the queue (scored above every ready message) so a
--   consumer blocked on BZMPOP wakes up and learns when to look again.

local rcall = redis.call
local PRIORITY_FACTOR = 10000000000000 -- 10^13 ms per priority level (317 years)
local WAKE_MEMBER = '~wake'
local WAKE_SCORE = 256 * PRIORITY_FACTOR

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: publish: ' .. message)
end

local function integer(value, default)
  if value == '' then return default end
  if not string.match(value, '^%-?%d+$') then return nil end
  return tonumber(value)
end

if #KEYS ~= 4 then return fail('expected 4 keys (queue, delayed, index, meta), got ' .. #KEYS) end
if #ARGV ~= 6 then return fail('expected 6 arguments, got ' .. #ARGV) end
local queue_key, delayed_key, index_key, meta_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local brace = string.find(queue_key, '{', 1, true)
if not brace then return fail("key '" .. queue_key .. "' has no {hash tag}") end

local prefix, payload = ARGV[1], ARGV[2]
if payload == '' then return fail('payload is missing or empty') end
local priority = integer(ARGV[3], 0)
if not priority or priority < 0 or priority > 255 then
  return fail("priority must be an integer in 0..255, got '" .. ARGV[3] .. "'")
end
local eta = integer(ARGV[4], 0)
if not eta or eta < 0 then return fail("eta_ms must be an integer >= 0, got '" .. ARGV[4] .. "'") end
local ttl = integer(ARGV[5], -1)
if not ttl or (ttl <= 0 and ttl ~= -1) then
  return fail("ttl_ms must be a positive integer or -1, got '" .. ARGV[5] .. "'")
end
local visibility = integer(ARGV[6], nil)
if not visibility or visibility <= 0 then
  return fail("visibility_ms must be a positive integer, got '" .. ARGV[6] .. "'")
end

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- Queue arguments declared by consumers apply to every producer.
local meta = rcall('HMGET', meta_key, 'expires', 'message_ttl', 'max_priority')
local expires, queue_ttl, max_priority = tonumber(meta[1]), tonumber(meta[2]), tonumber(meta[3])
if max_priority and priority > max_priority then priority = max_priority end
if queue_ttl and (ttl == -1 or queue_ttl < ttl) then ttl = queue_ttl end

local id = string.format('%016x', rcall('HINCRBY', meta_key, 'seq', 1))
local message_key = prefix .. string.sub(queue_key, brace) .. ':' .. id

if eta > now then
  rcall('HSET', message_key, 'payload', payload, 'priority', priority,
        'delivery_count', 0, 'state', 'delayed', 'eta', string.format('%d', eta))
  rcall('ZADD', delayed_key, string.format('%d', eta), id)
  rcall('ZADD', queue_key, string.format('%d', WAKE_SCORE), WAKE_MEMBER)
else
  rcall('HSET', message_key, 'payload', payload, 'priority', priority,
        'delivery_count', 0, 'state', 'ready')
  rcall('ZADD', queue_key, string.format('%d', (255 - priority) * PRIORITY_FACTOR + now), id)
  rcall('ZADD', index_key, string.format('%d', now + visibility), id)
end
if ttl > 0 then rcall('PEXPIRE', message_key, ttl) end

if expires then
  for i = 1, 4 do rcall('PEXPIRE', KEYS[i], expires) end
end
return id
