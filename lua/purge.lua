#!lua flags=allow-oom
-- name: purge
-- version: 1
-- summary: Delete a batch of the ready and delayed messages of one queue; in-flight messages are left alone.
-- KEYS: 3
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
-- ARGV:
--   1  message_key_prefix  string             P message: ; the hash is prefix .. '{Q}:' .. id
--   2  batch               integer 1..100000  most messages deleted by this call
-- returns: array {purged, remaining}: remaining > 0 means call again
-- errors:
--   ERR celery-redis-lua: purge: expected 3 keys (queue, delayed, index), got N
--   ERR celery-redis-lua: purge: expected 2 arguments, got N
--   ERR celery-redis-lua: purge: key 'K' has no {hash tag}
--   ERR celery-redis-lua: purge: batch must be an integer in 1..100000, got 'V'
-- why: batched so that purging a million messages never blocks the server for long.
--   allow-oom, because purging frees memory.

local rcall = redis.call

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: purge: ' .. message)
end

if #KEYS ~= 3 then return fail('expected 3 keys (queue, delayed, index), got ' .. #KEYS) end
if #ARGV ~= 2 then return fail('expected 2 arguments, got ' .. #ARGV) end
local brace = string.find(KEYS[1], '{', 1, true)
if not brace then return fail("key '" .. KEYS[1] .. "' has no {hash tag}") end
local batch = string.match(ARGV[2], '^%d+$') and tonumber(ARGV[2])
if not batch or batch < 1 or batch > 100000 then
  return fail("batch must be an integer in 1..100000, got '" .. ARGV[2] .. "'")
end
local message_prefix = ARGV[1] .. string.sub(KEYS[1], brace) .. ':'

local purged = 0
for _, key in ipairs({KEYS[1], KEYS[2]}) do
  local ids = rcall('ZRANGE', key, 0, batch - purged - 1)
  for _, id in ipairs(ids) do
    rcall('ZREM', key, id)
    if id ~= '~wake' then
      rcall('ZREM', KEYS[3], id)
      rcall('DEL', message_prefix .. id)
      purged = purged + 1
    end
  end
  if purged >= batch then break end
end
return {purged, rcall('ZCARD', KEYS[1]) + rcall('ZCARD', KEYS[2])}
