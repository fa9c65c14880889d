#!lua
-- name: migrated
-- version: 1
-- summary: Keep a migration's record of the stock messages already published into a queue: mark one, forget one, or clear the record.
-- KEYS: 1
--   record   HASH    P migrated:{Q}   message identity (task id, or SHA1 of the payload) -> 1
-- ARGV:
--   1  action    string  mark, forget or clear
--   2  identity  string  the message's identity (mark and forget; clear takes none)
-- returns: integer, 1 if the record changed (marked anew, forgotten, cleared), else 0
-- errors:
--   ERR celery-redis-lua: migrated: expected 1 key (record), got N
--   ERR celery-redis-lua: migrated: action must be mark, forget or clear, got X
--   ERR celery-redis-lua: migrated: mark and forget take one identity (a non-empty string)
--   ERR celery-redis-lua: migrated: clear takes no identity
-- why: `celery-redis-lua migrate` runs mark in one MULTI with the publish, so a rerun after a
--   crash publishes nothing twice; forget undoes a mark whose publish was refused. No flags:
--   a migration into a server out of memory stops at its first message instead of marking it.

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: migrated: ' .. message)
end

if #KEYS ~= 1 then return fail('expected 1 key (record), got ' .. #KEYS) end
local action, identity = ARGV[1], ARGV[2]
if action == 'clear' then
  if #ARGV ~= 1 then return fail('clear takes no identity') end
  return redis.call('DEL', KEYS[1])
end
if action ~= 'mark' and action ~= 'forget' then
  return fail('action must be mark, forget or clear, got ' .. tostring(action))
end
if #ARGV ~= 2 or identity == '' then
  return fail('mark and forget take one identity (a non-empty string)')
end
if action == 'mark' then
  return redis.call('HSETNX', KEYS[1], identity, '1')
end
return redis.call('HDEL', KEYS[1], identity)
