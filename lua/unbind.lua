#!lua flags=allow-oom
-- name: unbind
-- version: 2
-- summary: Remove bindings from an exchange's binding table.
-- KEYS: 1
--   table    ZSET    P binding:<exchange>           member routing_key SEP pattern SEP queue -> stale-at unix ms
-- ARGV:
--   1.. member  string   routing_key .. sep .. pattern .. sep .. queue
-- returns: integer, how many members were removed
-- errors:
--   ERR celery-redis-lua: unbind: expected 1 key (binding table), got N
--   ERR celery-redis-lua: unbind: expected at least one member
-- why: allow-oom, because removing a binding frees memory.

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: unbind: ' .. message)
end

if #KEYS ~= 1 then return fail('expected 1 key (binding table), got ' .. #KEYS) end
if #ARGV < 1 then return fail('expected at least one member') end
return redis.call('ZREM', KEYS[1], unpack(ARGV))
