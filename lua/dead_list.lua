#!lua flags=no-writes
-- name: dead_list
-- version: 1
-- summary: List dead letters of one queue, oldest first.
-- KEYS: 1
--   dead     STREAM  P dead:{Q}   dead letters: id, reason, delivery_count, priority, payload
-- ARGV:
--   1  count   integer 1..10000   most entries returned
--   2  after   stream id or ''    return entries after this one ('' starts at the oldest)
-- returns: array of entries, each {entry_id, {field, value, ...}} as XRANGE returns them
-- errors:
--   ERR celery-redis-lua: dead_list: expected 1 key (dead), got N
--   ERR celery-redis-lua: dead_list: expected 2 arguments, got N
--   ERR celery-redis-lua: dead_list: count must be an integer in 1..10000, got 'V'
--   ERR celery-redis-lua: dead_list: after must be a stream id or empty, got 'V'
-- why: paging by entry id keeps each call short however long the stream is.

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: dead_list: ' .. message)
end

if #KEYS ~= 1 then return fail('expected 1 key (dead), got ' .. #KEYS) end
if #ARGV ~= 2 then return fail('expected 2 arguments, got ' .. #ARGV) end
local count = string.match(ARGV[1], '^%d+$') and tonumber(ARGV[1])
if not count or count < 1 or count > 10000 then
  return fail("count must be an integer in 1..10000, got '" .. ARGV[1] .. "'")
end
local start = '-'
if ARGV[2] ~= '' then
  if not string.match(ARGV[2], '^%d+%-%d+$') then
    return fail("after must be a stream id or empty, got '" .. ARGV[2] .. "'")
  end
  start = '(' .. ARGV[2]
end
return redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', count)
