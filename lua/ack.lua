#!lua flags=allow-oom
-- name: ack
-- version: 3
-- summary: Acknowledge messages of one queue: delete them and every trace of them.
-- KEYS: 7
--   queue    ZSET    P queue:{Q}           ready messages (a restored copy of an acked message is removed too)
--   delayed  ZSET    P delayed:{Q}         delayed messages (not touched)
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments (not touched)
--   dead     STREAM  P dead:{Q}            dead letters (not touched)
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT'; the message's task-id index entries go too
-- ARGV:
--   1.. id  string   message ids to acknowledge
-- returns: integer, how many of the messages still existed
-- errors:
--   ERR celery-redis-lua: ack: expected 7 keys (queue, delayed, index, meta, dead, message, state), got N
--   ERR celery-redis-lua: ack: expected at least one id
-- why: allow-oom, because acking frees memory and must work on a full server. Acking a
--   message that the sweep already put back (visibility timeout passed) cancels the
--   restored copy, so a slow but successful task does not run again. Acking twice is
--   harmless: ids are never reused, so a late or repeated ack cannot touch another message.
--   Every queue script takes the same seven keys, so a caller builds them in one place.

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

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: ack: ' .. message)
end

if #KEYS ~= 7 then
  return fail('expected 7 keys (queue, delayed, index, meta, dead, message, state), got ' .. #KEYS)
end
if #ARGV < 1 then return fail('expected at least one id') end

-- One command over many arguments, in chunks that Lua's unpack() can take.
local function variadic(command, key)
  local total = 0
  for first = 1, #ARGV, 4000 do
    total = total + rcall(command, key, unpack(ARGV, first, math.min(first + 3999, #ARGV)))
  end
  return total
end

for _, id in ipairs(ARGV) do forget_task(KEYS[7], id) end
variadic('ZREM', KEYS[3])
variadic('ZREM', KEYS[1])
variadic('HDEL', KEYS[7])
return variadic('HDEL', KEYS[6])
