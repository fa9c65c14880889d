#!lua flags=no-writes
-- name: stats
-- version: 4
-- summary: Count ready, delayed, in-flight and dead-lettered messages per queue.
-- KEYS: 8 per queue, repeated for each queue (all queues of one call must share a cluster slot)
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  in-flight messages and ready ones with a TTL (not read)
--   meta     HASH    P meta:{Q}            queue arguments (not read)
--   dead     STREAM  P dead:{Q}            dead letters
--   message  HASH    P message:{Q}         id -> payload (counted)
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]' (not read)
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (not read)
-- ARGV: none
-- returns: array of 4 integers per queue: ready, delayed, in_flight, dead
-- errors:
--   ERR celery-redis-lua: stats: expected 8 keys per queue, got N
-- why: in_flight is the messages stored minus those ready or delayed (a message is in one
--   of the three); it can be off by orphans until the next sweep. Every count is O(1), so
--   stats stays cheap on a queue of a million messages.

local rcall = redis.call
local QUEUE_KEYS = 8

if #KEYS == 0 or #KEYS % QUEUE_KEYS ~= 0 then
  return redis.error_reply('ERR celery-redis-lua: stats: expected 8 keys per queue, got ' .. #KEYS)
end
local reply = {}
for q = 1, #KEYS / QUEUE_KEYS do
  local base = QUEUE_KEYS * (q - 1)
  local ready, delayed = rcall('ZCARD', KEYS[base + 1]), rcall('ZCARD', KEYS[base + 2])
  reply[#reply + 1] = ready
  reply[#reply + 1] = delayed
  reply[#reply + 1] = math.max(0, rcall('HLEN', KEYS[base + 6]) - ready - delayed)
  reply[#reply + 1] = rcall('XLEN', KEYS[base + 5])
end
return reply
