#!lua flags=allow-oom
-- name: ack
-- version: 6
-- summary: Acknowledge messages of one queue: delete them and every trace of them.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages (a restored copy of an acked message is removed too)
--   delayed  ZSET    P delayed:{Q}         delayed messages (not touched)
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments (not touched); 'limits' (and 'paused' when it holds a cap) are read
--   dead     STREAM  P dead:{Q}            dead letters (not touched)
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]'; the message's task-id index entry goes too
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (dropped when an ack leaves nothing queued; pushed when it frees a slot of a capped queue)
-- ARGV:
--   1.. id  string   message ids to acknowledge
-- returns: integer, how many of the messages still existed
-- errors:
--   ERR celery-redis-lua: ack: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: ack: expected at least one id
-- why: allow-oom, because acking frees memory and must work on a full server. Acking a
--   message that the sweep already put back (visibility timeout passed) cancels the
--   restored copy, so a slow but successful task does not run again. Acking twice is
--   harmless: ids are never reused, so a late or repeated ack cannot touch another message.
--   Every queue script takes the same eight keys, so a caller builds them in one place.
--   An ack frees a slot: in a queue with an in-flight cap (the limit script) with messages
--   ready, it pushes the wake token, so a consumer the cap held back takes the slot at once.

local rcall = redis.call

-- A consumer with nothing to do blocks on the wake list (BLPOP); a token there wakes one,
-- which runs consume. Pushed only into an empty list: one LLEN while a token already waits.
local function arm_wake(wake_key)
  if redis.call('LLEN', wake_key) > 0 then return false end
  redis.call('RPUSH', wake_key, '1')
  return true
end

-- A slot freed in a queue with an in-flight cap (the limit script: meta's 'limits' is
-- 'IN_FLIGHT RATE', '-' for unset) wakes a consumer the cap held back (consume dropped the
-- token when it stopped at the cap), when something is ready or delayed (it learns the
-- ETA) and the queue is not paused. A queue without a cap pays one HGET of one field.
local function wake_freed_slot(meta_key, queue_key, delayed_key, wake_key)
  local limits = redis.call('HGET', meta_key, 'limits')
  if not limits or not string.match(limits, '^%d') then return end
  if redis.call('ZCARD', queue_key) + redis.call('ZCARD', delayed_key) > 0
      and redis.call('HEXISTS', meta_key, 'paused') == 0 then
    arm_wake(wake_key)
  end
end

-- A token wakes a consumer for something that is there; with nothing ready or delayed it
-- would wake one in vain, and outlive the queue's messages: it goes.
local function drop_idle_wake(queue_key, delayed_key, wake_key)
  if redis.call('ZCARD', queue_key) == 0 and redis.call('ZCARD', delayed_key) == 0 then
    redis.call('DEL', wake_key)
  end
end

-- The task-id index (publish writes it, where/cancel read it): 'task:<task id>' -> message
-- id, a field of the state hash; the task id is also the last word of the message's state
-- string (parse_state's `task`). A message that goes takes its entry with it; a newer
-- message of the same task id (a retry) keeps its own.
local function forget_task(state_key, id, s)
  if s and s.task ~= '' and redis.call('HGET', state_key, 'task:' .. s.task) == id then
    redis.call('HDEL', state_key, 'task:' .. s.task)
  end
end

-- 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]'; a malformed value reads as a fresh
-- ready message. The task id goes last because it may hold spaces; '' when there is none.
local function parse_state(value)
  local state, count, priority, expires_at, task = string.match(value, '^(%a+) (%d+) (%d+) (%S+) ?(.*)$')
  if not state then return {state = 'ready', count = 0, priority = 0, expires_at = '-', task = ''} end
  return {state = state, count = tonumber(count), priority = tonumber(priority), expires_at = expires_at,
          task = task}
end

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: ack: ' .. message)
end

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
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

for first = 1, #ARGV, 4000 do -- each state names its task id, if any
  local states = rcall('HMGET', KEYS[7], unpack(ARGV, first, math.min(first + 3999, #ARGV)))
  for i, raw in ipairs(states) do
    if raw then forget_task(KEYS[7], ARGV[first + i - 1], parse_state(raw)) end
  end
end
variadic('ZREM', KEYS[3])
if variadic('ZREM', KEYS[1]) > 0 then -- a copy the sweep had put back: its wake may be idle now
  drop_idle_wake(KEYS[1], KEYS[2], KEYS[8])
end
variadic('HDEL', KEYS[7])
local acked = variadic('HDEL', KEYS[6])
if acked > 0 then wake_freed_slot(KEYS[4], KEYS[1], KEYS[2], KEYS[8]) end
return acked
