#!lua
-- name: unpop
-- version: 4
-- summary: Give back the wake token a blocked consumer's BLPOP took, when it stops before it consumes.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages (decides whether the token goes back)
--   delayed  ZSET    P delayed:{Q}         delayed messages (decides whether the token goes back)
--   index    ZSET    P messages_index:{Q}  expiry refresh only
--   meta     HASH    P meta:{Q}            queue arguments; 'expires' (ms) is refreshed on all eight keys; 'paused' is read
--   dead     STREAM  P dead:{Q}            expiry refresh only
--   message  HASH    P message:{Q}         expiry refresh only
--   state    HASH    P state:{Q}           expiry refresh only
--   wake     LIST    P wake:{Q}            the wake token a blocked consumer's BLPOP took
-- ARGV: none
-- returns: integer, 1 when the token went back, 0 when nothing is queued, the queue is paused or a token already waits
-- errors:
--   ERR celery-redis-lua: unpop: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: unpop: expected no arguments, got N
-- why: no message is ever popped by a blocking command (consume takes messages and marks
--   them in flight in one step), so a consumer that stops (close, cancel) at the instant
--   its BLPOP took the wake token has taken nothing but the token. Another blocked
--   consumer may be waiting for it: it goes back while the queue holds ready or delayed
--   messages. Were it lost (a consumer killed at that instant), the others would wait out
--   their blocking_timeout, never lose a message. A queue with x-expires gets its expiry
--   back on all keys.
--   A stored 'expires' past 10 years (an older version's, or set by hand) counts as 10
--   years (stored_ms), so the expiry refresh never overflows string.format('%d').

local rcall = redis.call
local MAX_DURATION_MS = 315360000000 -- 10 years in ms, the longest duration taken or read back (bounds.py)

-- A duration stored in meta (ms), as the scripts apply it: one past MAX_DURATION_MS (an
-- older version took any integer, or a hand set it) counts as MAX_DURATION_MS, longer than
-- anything waits, instead of overflowing the sums with the clock; not a positive integer:
-- nil, not set.
local function stored_ms(value)
  local n = value and string.match(value, '^%d+$') and tonumber(value)
  if not n or n < 1 then return nil end
  return math.min(n, MAX_DURATION_MS)
end

-- A consumer with nothing to do blocks on the wake list (BLPOP); a token there wakes one,
-- which runs consume. Pushed only into an empty list: one LLEN while a token already waits.
local function arm_wake(wake_key)
  if redis.call('LLEN', wake_key) > 0 then return false end
  redis.call('RPUSH', wake_key, '1')
  return true
end

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: unpop: ' .. message)
end

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
if #ARGV ~= 0 then return fail('expected no arguments, got ' .. #ARGV) end

local back = 0
if rcall('ZCARD', KEYS[1]) + rcall('ZCARD', KEYS[2]) > 0 and rcall('HEXISTS', KEYS[4], 'paused') == 0
    and arm_wake(KEYS[8]) then
  back = 1 -- a paused queue wakes nobody: its token stays dropped
end
local expires = stored_ms(rcall('HGET', KEYS[4], 'expires'))
if expires then
  local time = rcall('TIME')
  local at = string.format('%d', tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000) + expires)
  for i = 1, 8 do rcall('PEXPIREAT', KEYS[i], at) end -- one absolute time: the keys expire together
end
return back
