#!lua flags=no-writes
-- name: size
-- version: 3
-- summary: Count the ready messages of a queue (what kombu calls the queue's size).
-- KEYS: 1
--   queue    ZSET    P queue:{Q}   ready messages
-- ARGV: none
-- returns: integer, the number of ready messages
-- errors:
--   ERR celery-redis-lua: size: expected 1 key (queue), got N
-- why: a script rather than a bare ZCARD so that what counts as ready lives in Lua only:
--   the layout may change under a stable script name (the ZSET held a wake marker until
--   version 3).

if #KEYS ~= 1 then
  return redis.error_reply('ERR celery-redis-lua: size: expected 1 key (queue), got ' .. #KEYS)
end
return redis.call('ZCARD', KEYS[1])
