#!lua flags=no-writes
-- name: exists
-- version: 2
-- summary: Tell whether a queue exists (was declared or published to, and has not expired or been deleted).
-- KEYS: 1
--   meta     HASH    P meta:{Q}   queue arguments and the last id; it is what makes a queue exist
-- ARGV: none
-- returns: integer, 1 if the queue exists, else 0
-- errors:
--   ERR celery-redis-lua: exists: expected 1 key (meta), got N
-- why: kombu's passive queue_declare asks this; meta:{Q} outlives the queue's messages.

if #KEYS ~= 1 then
  return redis.error_reply('ERR celery-redis-lua: exists: expected 1 key (meta), got ' .. #KEYS)
end
return redis.call('EXISTS', KEYS[1])
