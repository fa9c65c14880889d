#!lua flags=no-writes
-- name: stats
-- version: 3
-- summary: Count ready, delayed, in-flight and dead-lettered messages per queue.
-- KEYS: 7 per queue, repeated for each queue (all queues of one call must share a cluster slot)
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  ready and in-flight messages
--   meta     HASH    P meta:{Q}            queue arguments (not read)
--   dead     STREAM  P dead:{Q}            dead letters
--   message  HASH    P message:{Q}         id -> payload (not read)
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]' (not read)
-- ARGV: none
-- returns: array of 4 integers per queue: ready, delayed, in_flight, dead
-- errors:
--   ERR celery-redis-lua: stats: expected 7 keys per queue, got N
-- why: in_flight is index entries minus ready messages, which every ready message also
--   has; it can be off by orphans until the next sweep. Every count is O(log N), so stats
--   stays cheap on a queue of a million messages.

local rcall = redis.call
local PRIORITY_FACTOR = 10000000000000 -- 10^13 ms per priority level (317 years)
local WAKE_SCORE = 256 * PRIORITY_FACTOR -- above every ready score
local READY_MAX = '(' .. string.format('%d', WAKE_SCORE) -- every ready score, not the wake marker
local QUEUE_KEYS = 7

if #KEYS == 0 or #KEYS % QUEUE_KEYS ~= 0 then
  return redis.error_reply('ERR celery-redis-lua: stats: expected 7 keys per queue, got ' .. #KEYS)
end
local reply = {}
for q = 1, #KEYS / QUEUE_KEYS do
  local base = QUEUE_KEYS * (q - 1)
  local ready = rcall('ZCOUNT', KEYS[base + 1], '-inf', READY_MAX)
  reply[#reply + 1] = ready
  reply[#reply + 1] = rcall('ZCARD', KEYS[base + 2])
  reply[#reply + 1] = math.max(0, rcall('ZCARD', KEYS[base + 3]) - ready)
  reply[#reply + 1] = rcall('XLEN', KEYS[base + 5])
end
return reply
