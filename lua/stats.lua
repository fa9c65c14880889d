#!lua flags=no-writes
-- name: stats
-- version: 1
-- summary: Count ready, delayed, in-flight and dead-lettered messages per queue.
-- KEYS: 4 per queue, repeated for each queue (all queues of one call must share a cluster slot)
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  ready and in-flight messages
--   dead     STREAM  P dead:{Q}            dead letters
-- ARGV: none
-- returns: array of 4 integers per queue: ready, delayed, in_flight, dead
-- errors:
--   ERR celery-redis-lua: stats: expected 4 keys per queue, got N
-- why: in_flight is index entries minus ready messages, which every ready message also
--   has; it can be off by messages whose hash expired until the next sweep.

local rcall = redis.call
if #KEYS == 0 or #KEYS % 4 ~= 0 then
  return redis.error_reply('ERR celery-redis-lua: stats: expected 4 keys per queue, got ' .. #KEYS)
end
local reply = {}
for q = 1, #KEYS / 4 do
  local ready = rcall('ZCOUNT', KEYS[4 * q - 3], '-inf', '(2560000000000000')
  reply[#reply + 1] = ready
  reply[#reply + 1] = rcall('ZCARD', KEYS[4 * q - 2])
  reply[#reply + 1] = math.max(0, rcall('ZCARD', KEYS[4 * q - 1]) - ready)
  reply[#reply + 1] = rcall('XLEN', KEYS[4 * q])
end
return reply
