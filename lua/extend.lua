#!lua
-- name: extend
-- version: 6
-- summary: Push the visibility deadlines of in-flight messages of one queue forward, and refresh the queue's expiry.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages (expiry refresh only)
--   delayed  ZSET    P delayed:{Q}         delayed messages (expiry refresh only)
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments; 'expires' (ms) is refreshed on all eight keys
--   dead     STREAM  P dead:{Q}            dead letters (expiry refresh only)
--   message  HASH    P message:{Q}         id -> payload (expiry refresh only)
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]' (expiry refresh only)
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (expiry refresh only)
-- ARGV:
--   1   visibility_ms  integer 1..315360000000   new deadline of each id, from now
--   2.. id             string        in-flight message ids (may be none: then only the expiry is refreshed)
-- returns: integer, how many ids were still indexed and got a new deadline
-- errors:
--   ERR celery-redis-lua: extend: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: extend: visibility_ms must be an integer in 1..315360000000, got 'V'
-- why: ids that were acked meanwhile are not re-added (ZADD XX), so a heartbeat racing an
--   ack cannot resurrect an index entry. A consumer calls this often enough (well within
--   x-expires) that a queue with a live consumer never expires, as in RabbitMQ.
--   visibility_ms is at most 10 years (315360000000 ms), so that now plus it stays an exact
--   double and string.format('%d') cannot overflow (protocol/bounds.py).
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

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: extend: ' .. message)
end

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
local visibility = ARGV[1] and string.match(ARGV[1], '^%d+$') and tonumber(ARGV[1])
if not visibility or visibility <= 0 or visibility > MAX_DURATION_MS then
  return fail("visibility_ms must be an integer in 1.." .. string.format('%d', MAX_DURATION_MS) .. ", got '" ..
              tostring(ARGV[1]) .. "'")
end

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local deadline = string.format('%d', now + visibility)

-- Two calls per 2,000 ids, not two per id: ZMSCORE tells which are still indexed, one ZADD XX
-- moves them all (a chunk keeps unpack and a call under 4,000 arguments).
local extended = 0
for first = 2, #ARGV, 2000 do
  local last = math.min(first + 1999, #ARGV)
  local scores = rcall('ZMSCORE', KEYS[3], unpack(ARGV, first, last))
  local moved = {}
  for i = first, last do
    if scores[i - first + 1] then
      moved[#moved + 1] = deadline
      moved[#moved + 1] = ARGV[i]
    end
  end
  if #moved > 0 then
    rcall('ZADD', KEYS[3], 'XX', unpack(moved))
    extended = extended + #moved / 2
  end
end

local expires = stored_ms(rcall('HGET', KEYS[4], 'expires'))
if expires then
  local at = string.format('%d', now + expires) -- one absolute time: the keys expire together
  for i = 1, 8 do rcall('PEXPIREAT', KEYS[i], at) end
end
return extended
