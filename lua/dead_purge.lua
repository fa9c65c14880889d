#!lua flags=allow-oom
-- name: dead_purge
-- version: 1
-- summary: Delete all dead letters of one queue.
-- KEYS: 1
--   dead     STREAM  P dead:{Q}   dead letters
-- ARGV: none
-- returns: integer, how many entries were deleted
-- errors:
--   ERR celery-redis-lua: dead_purge: expected 1 key (dead), got N
-- why: allow-oom, because purging frees memory.

if #KEYS ~= 1 then
  return redis.error_reply('ERR celery-redis-lua: dead_purge: expected 1 key (dead), got ' .. #KEYS)
end
local entries = redis.call('XLEN', KEYS[1])
redis.call('DEL', KEYS[1])
return entries
