#!lua flags=allow-oom
-- name: reject
-- version: 2
-- summary: Reject delivered messages of one queue: requeue them (counted against the delivery limit) or drop them.
-- KEYS: 3
--   queue    ZSET    P queue:{Q}           ready messages
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   dead     STREAM  P dead:{Q}            dead letters: id, reason, delivery_count, priority, payload
-- ARGV:
--   1   message_key_prefix  string           P message: ; the hash is prefix .. '{Q}:' .. id
--   2   requeue             0 or 1           1: back to the queue as a redelivery; 0: drop
--   3   delivery_limit      integer >= 0     delivery attempts before a message is dead-lettered; 0 means no limit
--   4   dead_letter_maxlen  integer >= 0     approximate cap of the dead-letter stream; 0 deletes dropped messages outright
--   5   visibility_ms       integer > 0      how long a requeued message may sit popped but unclaimed
--   6.. id                  string           message ids to reject, each optionally as id:delivery_count
-- returns: array {requeued, dead_lettered, deleted, stale} counts
-- errors:
--   ERR celery-redis-lua: reject: expected 3 keys (queue, index, dead), got N
--   ERR celery-redis-lua: reject: expected at least 6 arguments, got N
--   ERR celery-redis-lua: reject: key 'K' has no {hash tag}
--   ERR celery-redis-lua: reject: requeue must be 0 or 1, got 'V'
--   ERR celery-redis-lua: reject: delivery_limit must be an integer >= 0, got 'V'
--   ERR celery-redis-lua: reject: dead_letter_maxlen must be an integer >= 0, got 'V'
--   ERR celery-redis-lua: reject: visibility_ms must be a positive integer, got 'V'
--   ERR celery-redis-lua: reject: id 'V' must be an id or id:delivery_count
-- why: delivery counting follows RabbitMQ quorum queues: the first delivery has count 0,
--   every requeue adds one, and a message whose next attempt would be number
--   delivery_limit + 1 is dead-lettered instead (reason 'delivery-limit'). A message
--   rejected without requeue is dead-lettered with reason 'rejected' so an operator can
--   see and replay it. allow-oom, because rejecting must work on a full server.
--   id:delivery_count rejects only that delivery: a message whose count has moved on
--   (the sweep restored it and another consumer holds it now) is left alone and
--   counted stale, so a late hand-back cannot requeue or drop someone else's delivery.

local rcall = redis.call
local PRIORITY_FACTOR = 10000000000000

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: reject: ' .. message)
end

local function natural(value)
  if not string.match(value, '^%d+$') then return nil end
  return tonumber(value)
end

if #KEYS ~= 3 then return fail('expected 3 keys (queue, index, dead), got ' .. #KEYS) end
if #ARGV < 6 then return fail('expected at least 6 arguments, got ' .. #ARGV) end
local queue_key, index_key, dead_key = KEYS[1], KEYS[2], KEYS[3]
local brace = string.find(queue_key, '{', 1, true)
if not brace then return fail("key '" .. queue_key .. "' has no {hash tag}") end
if ARGV[2] ~= '0' and ARGV[2] ~= '1' then return fail("requeue must be 0 or 1, got '" .. ARGV[2] .. "'") end
local requeue = ARGV[2] == '1'
local limit = natural(ARGV[3])
if not limit then return fail("delivery_limit must be an integer >= 0, got '" .. ARGV[3] .. "'") end
local dead_maxlen = natural(ARGV[4])
if not dead_maxlen then return fail("dead_letter_maxlen must be an integer >= 0, got '" .. ARGV[4] .. "'") end
local visibility = natural(ARGV[5])
if not visibility or visibility == 0 then
  return fail("visibility_ms must be a positive integer, got '" .. ARGV[5] .. "'")
end
local message_prefix = ARGV[1] .. string.sub(queue_key, brace) .. ':'

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- Validate every id before changing anything: a bad one must not leave a half-done batch.
local ids, expected = {}, {}
for i = 6, #ARGV do
  local id, count = string.match(ARGV[i], '^([^:]+):(%d+)$')
  if not id then
    if string.find(ARGV[i], ':', 1, true) or ARGV[i] == '' then
      return fail("id '" .. ARGV[i] .. "' must be an id or id:delivery_count")
    end
    id = ARGV[i]
  end
  ids[#ids + 1] = id
  expected[#ids] = count and tonumber(count)
end

local requeued, dead_lettered, deleted, stale = 0, 0, 0, 0
for i, id in ipairs(ids) do
  local message_key = message_prefix .. id
  local message = rcall('HMGET', message_key, 'payload', 'priority', 'delivery_count')
  if message[1] and expected[i] and expected[i] ~= (tonumber(message[3]) or 0) then
    stale = stale + 1 -- delivered again since: not this consumer's to reject
  elseif message[1] then
    local priority = tonumber(message[2]) or 0
    local attempts = (tonumber(message[3]) or 0) + 1
    if requeue and (limit == 0 or attempts < limit) then
      rcall('HSET', message_key, 'delivery_count', attempts, 'state', 'ready')
      rcall('ZADD', queue_key, string.format('%d', (255 - priority) * PRIORITY_FACTOR + now), id)
      rcall('ZADD', index_key, string.format('%d', now + visibility), id)
      requeued = requeued + 1
    else
      if dead_maxlen > 0 then
        rcall('XADD', dead_key, 'MAXLEN', '~', dead_maxlen, '*', 'id', id,
              'reason', requeue and 'delivery-limit' or 'rejected',
              'delivery_count', requeue and attempts or attempts - 1,
              'priority', priority, 'payload', message[1])
        dead_lettered = dead_lettered + 1
      else
        deleted = deleted + 1
      end
      rcall('DEL', message_key)
      rcall('ZREM', queue_key, id)
      rcall('ZREM', index_key, id)
    end
  else
    rcall('ZREM', index_key, id) -- already gone (acked elsewhere or expired)
  end
end
return {requeued, dead_lettered, deleted, stale}
