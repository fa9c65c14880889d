#!lua flags=allow-oom
-- name: delete
-- version: 1
-- summary: Delete a queue in batches: every message (ready, delayed, in flight), then its keys and dead letters.
-- KEYS: 5
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  in-flight (and ready) messages
--   meta     HASH    P meta:{Q}            queue arguments and the id sequence
--   dead     STREAM  P dead:{Q}            dead letters
-- ARGV:
--   1  message_key_prefix  string             P message: ; the hash is prefix .. '{Q}:' .. id
--   2  batch               integer 1..100000  most messages deleted by this call
-- returns: array {deleted, remaining}: remaining > 0 means call again; at 0 all five keys are gone
-- errors:
--   ERR celery-redis-lua: delete: expected 5 keys (queue, delayed, index, meta, dead), got N
--   ERR celery-redis-lua: delete: expected 2 arguments, got N
--   ERR celery-redis-lua: delete: key 'K' has no {hash tag}
--   ERR celery-redis-lua: delete: batch must be an integer in 1..100000, got 'V'
-- why: meta goes last, so that a queue half-way through deletion keeps its id sequence
--   and a publish racing the deletion cannot reuse an id. allow-oom: it frees memory.

local rcall = redis.call

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: delete: ' .. message)
end

if #KEYS ~= 5 then return fail('expected 5 keys (queue, delayed, index, meta, dead), got ' .. #KEYS) end
if #ARGV ~= 2 then return fail('expected 2 arguments, got ' .. #ARGV) end
local brace = string.find(KEYS[1], '{', 1, true)
if not brace then return fail("key '" .. KEYS[1] .. "' has no {hash tag}") end
local batch = string.match(ARGV[2], '^%d+$') and tonumber(ARGV[2])
if not batch or batch < 1 or batch > 100000 then
  return fail("batch must be an integer in 1..100000, got '" .. ARGV[2] .. "'")
end
local message_prefix = ARGV[1] .. string.sub(KEYS[1], brace) .. ':'

local deleted = 0
for _, key in ipairs({KEYS[1], KEYS[2], KEYS[3]}) do
  local ids = rcall('ZRANGE', key, 0, batch - deleted - 1)
  for _, id in ipairs(ids) do
    rcall('ZREM', key, id)
    deleted = deleted + rcall('DEL', message_prefix .. id)
  end
  if deleted >= batch then break end
end
local remaining = rcall('ZCARD', KEYS[1]) + rcall('ZCARD', KEYS[2]) + rcall('ZCARD', KEYS[3])
if remaining == 0 then rcall('DEL', KEYS[4], KEYS[5]) end
return {deleted, remaining}
