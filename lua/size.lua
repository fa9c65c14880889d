#!lua flags=no-writes
-- name: size
-- version: 2
-- summary: Count the ready messages of a queue (what kombu calls the queue's size).
-- KEYS: 1
--   queue    ZSET    P queue:{Q}   ready messages
-- ARGV: none
-- returns: integer, the number of ready messages (the wake marker is not counted)
-- errors:
--   ERR celery-redis-lua: size: expected 1 key (queue), got N
-- why: a script rather than a bare ZCARD so that the wake marker rule lives in Lua only.

if #KEYS ~= 1 then
  return redis.error_reply('ERR celery-redis-lua: size: expected 1 key (queue), got ' .. #KEYS)
end
local PRIORITY_FACTOR = 10000000000000 -- 10^13 ms per priority level (317 years)
local WAKE_SCORE = 256 * PRIORITY_FACTOR -- above every ready score
local READY_MAX = '(' .. string.format('%d', WAKE_SCORE) -- every ready score, not the wake marker
return redis.call('ZCOUNT', KEYS[1], '-inf', READY_MAX)
