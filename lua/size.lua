#!lua flags=no-writes
-- name: size
-- version: 1
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
return redis.call('ZCOUNT', KEYS[1], '-inf', '(2560000000000000')
