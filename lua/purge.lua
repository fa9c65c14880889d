#!lua flags=allow-oom
-- name: purge
-- version: 8
-- summary: Delete a batch of the ready and delayed messages of one queue; in-flight messages are left alone.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments; counter 'retrying' (less the retry-waiting messages purged)
--   dead     STREAM  P dead:{Q}            dead letters (not touched)
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (dropped once nothing is queued)
-- ARGV:
--   1  batch  integer 1..100000  most messages deleted by this call
-- returns: array {purged, remaining}: remaining > 0 means call again
-- errors:
--   ERR celery-redis-lua: purge: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: purge: expected 1 argument, got N
--   ERR celery-redis-lua: purge: batch must be an integer in 1..100000, got 'V'
-- why: batched so that purging a million messages never blocks the server for long.
--   allow-oom, because purging frees memory.

local rcall = redis.call

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
-- message of the same task id (a retry) keeps its own. 'revoked:<task id>' (cancel, for a
-- delivery Celery's revoke() named) goes in the same call. So does the hold on a dedup id
-- (publish's simple and debounce modes: 'dedup:<sha1 of the id>' -> 'HOLDER UNTIL MODE ID',
-- the sha1 also in the message's state string), when it is still this message's.
local function forget_task(state_key, id, s)
  if not s then return end
  if s.task ~= '' and redis.call('HGET', state_key, 'task:' .. s.task) == id then
    redis.call('HDEL', state_key, 'task:' .. s.task, 'revoked:' .. s.task)
  end
  if s.dedup ~= '' then
    local hold = redis.call('HGET', state_key, 'dedup:' .. s.dedup)
    if hold and string.sub(hold, 1, #id + 1) == id .. ' ' then
      redis.call('HDEL', state_key, 'dedup:' .. s.dedup)
    end
  end
end

-- 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'; a malformed value reads as a
-- fresh ready message. DEDUP: the sha1 (hex) of the dedup id this message holds until it goes
-- (publish's simple and debounce modes), '' when none. The task id goes last because it may
-- hold spaces; '' when there is none.
local function parse_state(value)
  local state, count, priority, expires_at, dedup, task =
    string.match(value, '^(%a+) (%d+) (%d+) ([^%s:]+):?(%x*) ?(.*)$')
  if not state then return {state = 'ready', count = 0, priority = 0, expires_at = '-', dedup = '', task = ''} end
  return {state = state, count = tonumber(count), priority = tonumber(priority), expires_at = expires_at,
          dedup = dedup, task = task}
end

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: purge: ' .. message)
end

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
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

local purged, retrying = 0, 0
for _, key in ipairs({KEYS[1], KEYS[2]}) do
  local messages = rcall('ZRANGE', key, 0, batch - purged - 1)
  variadic('ZREM', key, messages)
  variadic('ZREM', KEYS[3], messages)
  variadic('HDEL', KEYS[6], messages)
  for _, id in ipairs(messages) do
    local raw = rcall('HGET', KEYS[7], id)
    local s = raw and parse_state(raw)
    if s then forget_task(KEYS[7], id, s) end
    if s and s.state == 'retry' then retrying = retrying + 1 end
  end
  variadic('HDEL', KEYS[7], messages)
  purged = purged + #messages
  if purged >= batch then break end
end
if retrying > 0 then rcall('HINCRBY', KEYS[4], 'retrying', -retrying) end
drop_idle_wake(KEYS[1], KEYS[2], KEYS[8])
return {purged, rcall('ZCARD', KEYS[1]) + rcall('ZCARD', KEYS[2])}
