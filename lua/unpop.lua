#!lua
-- name: unpop
-- version: 2
-- summary: Put messages that a BZMPOP popped back into their queue, uncounted, when nobody will claim them.
-- KEYS: 7
--   queue    ZSET    P queue:{Q}           the queue BZMPOP popped from
--   delayed  ZSET    P delayed:{Q}         delayed messages (decides whether the wake marker goes back)
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again (not touched)
--   meta     HASH    P meta:{Q}            queue arguments; 'expires' (ms) is refreshed on all seven keys
--   dead     STREAM  P dead:{Q}            dead letters (expiry refresh only)
--   message  HASH    P message:{Q}         id -> payload (expiry refresh only)
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]'
-- ARGV:
--   1.. popped  number, string   score, id, score, id, ...: each popped entry as BZMPOP returned it
-- returns: integer, how many messages went back
-- errors:
--   ERR celery-redis-lua: unpop: expected 7 keys (queue, delayed, index, meta, dead, message, state), got N
--   ERR celery-redis-lua: unpop: expected score, id pairs, got N arguments
--   ERR celery-redis-lua: unpop: score 'V' is not a number
-- why: a consumer that stops (close, cancel) at the instant its BZMPOP popped something
--   has delivered nothing: the messages go back with their old scores (same place in
--   line) and their delivery count unchanged. A message the sweep already restored and
--   another consumer holds ('unacked') or that is gone is left alone; the wake marker goes
--   back only while something is still delayed. The queue key may have been emptied
--   (and so deleted) by the pop: a queue with x-expires gets its expiry back on all keys.

local rcall = redis.call
local WAKE_MEMBER = '~wake' -- wakes a consumer blocked on BZMPOP when something is delayed

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: unpop: ' .. message)
end

if #KEYS ~= 7 then
  return fail('expected 7 keys (queue, delayed, index, meta, dead, message, state), got ' .. #KEYS)
end
if #ARGV == 0 or #ARGV % 2 ~= 0 then return fail('expected score, id pairs, got ' .. #ARGV .. ' arguments') end
for i = 1, #ARGV, 2 do
  if not tonumber(ARGV[i]) then return fail("score '" .. ARGV[i] .. "' is not a number") end
end

local restored = 0
for i = 1, #ARGV, 2 do
  local score, id = ARGV[i], ARGV[i + 1]
  if id == WAKE_MEMBER then
    if rcall('ZCARD', KEYS[2]) > 0 then rcall('ZADD', KEYS[1], score, id) end
  else
    local raw = rcall('HGET', KEYS[7], id)
    if raw and string.sub(raw, 1, 6) == 'ready ' then
      restored = restored + rcall('ZADD', KEYS[1], 'NX', score, id)
    end
  end
end
local expires = tonumber(rcall('HGET', KEYS[4], 'expires'))
if expires then
  local time = rcall('TIME')
  local at = string.format('%d', tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + expires)
  for i = 1, 7 do rcall('PEXPIREAT', KEYS[i], at) end -- one absolute time: the keys expire together
end
return restored
