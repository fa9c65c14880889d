#!lua flags=allow-oom
-- name: fanout_unbind
-- version: 1
-- summary: Remove a queue's consumer group from a fanout exchange's stream (the queue was deleted or unbound).
-- KEYS: 2
--   stream   STREAM  P /<db>.<exchange>            fanout messages
--   groups   HASH    {P /<db>.<exchange>}:groups   bound queue -> 'ACTIVE_AT EXPIRES TTL'
-- ARGV:
--   1  queue  string, non-empty   the queue whose group goes
-- returns: integer, 1 if a group was destroyed, else 0
-- errors:
--   ERR celery-redis-lua: fanout_unbind: expected 2 keys (stream, groups), got N
--   ERR celery-redis-lua: fanout_unbind: expected 1 argument, got N
--   ERR celery-redis-lua: fanout_unbind: queue is missing or empty
-- why: a deleted queue's group would otherwise stay on the stream for good. allow-oom,
--   because it only frees memory.

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: fanout_unbind: ' .. message)
end

if #KEYS ~= 2 then return fail('expected 2 keys (stream, groups), got ' .. #KEYS) end
if #ARGV ~= 1 then return fail('expected 1 argument, got ' .. #ARGV) end
if ARGV[1] == '' then return fail('queue is missing or empty') end

redis.call('HDEL', KEYS[2], ARGV[1])
local destroyed = redis.pcall('XGROUP', 'DESTROY', KEYS[1], ARGV[1])
if type(destroyed) ~= 'number' then return 0 end -- no stream: nothing to destroy
return destroyed
