#!lua flags=allow-oom
-- name: purge
-- version: 3
-- summary: Delete a batch of the ready and delayed messages of one queue; in-flight messages are left alone.
-- KEYS: 7
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments (not touched)
--   dead     STREAM  P dead:{Q}            dead letters (not touched)
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT'
-- ARGV:
--   1  batch  integer 1..100000  most messages deleted by this call
-- returns: array {purged, remaining}: remaining > 0 means call again
-- errors:
--   ERR celery-redis-lua: purge: expected 7 keys (queue, delayed, index, meta, dead, message, state), got N
--   ERR celery-redis-lua: purge: expected 1 argument, got N
--   ERR celery-redis-lua: purge: batch must be an integer in 1..100000, got 'V'
-- why: batched so that purging a million messages never blocks the server for long.
--   allow-oom, because purging frees memory.

local rcall = redis.call

-- The task-id index (publish writes it, where/cancel read it): 'task:<task id>' -> message
-- id and 'tid:<message id>' -> task id, fields of the state hash. A message that goes takes
-- its entries with it; a newer message of the same task id (a retry) keeps its own.
local function forget_task(state_key, id)
  local task = redis.call('HGET', state_key, 'tid:' .. id)
  if task then
    local by_task = 'task:' .. task
    if redis.call('HGET', state_key, by_task) == id then
      redis.call('HDEL', state_key, 'tid:' .. id, by_task)
    else
      redis.call('HDEL', state_key, 'tid:' .. id)
    end
  end
end
local WAKE_MEMBER = '~wake' -- wakes a consumer blocked on BZMPOP when something is delayed

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: purge: ' .. message)
end

if #KEYS ~= 7 then
  return fail('expected 7 keys (queue, delayed, index, meta, dead, message, state), got ' .. #KEYS)
end
if #ARGV ~= 1 then return fail('expected 1 argument, got ' .. #ARGV) end
local batch = string.match(ARGV[1], '^%d+$') and tonumber(ARGV[1])
if not batch or batch < 1 or batch > 100000 then
  return fail("batch must be an integer in 1..100000, got '" .. ARGV[1] .. "'")
end

-- One command over many arguments, in chunks that Lua's unpack() can take.
local function variadic(command, key, items)
  for first = 1, #items, 4000 do
    rcall(command, key, unpack(items, first, math.min(first + 3999, #items)))
  end
end

local purged = 0
for _, key in ipairs({KEYS[1], KEYS[2]}) do
  local ids = rcall('ZRANGE', key, 0, batch - purged - 1)
  local messages = {}
  for _, id in ipairs(ids) do
    if id ~= WAKE_MEMBER then messages[#messages + 1] = id end
  end
  variadic('ZREM', key, ids)
  variadic('ZREM', KEYS[3], messages)
  variadic('HDEL', KEYS[6], messages)
  for _, id in ipairs(messages) do forget_task(KEYS[7], id) end
  variadic('HDEL', KEYS[7], messages)
  purged = purged + #messages
  if purged >= batch then break end
end
return {purged, rcall('ZCARD', KEYS[1]) + rcall('ZCARD', KEYS[2])}
