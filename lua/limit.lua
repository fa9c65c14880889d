#!lua
-- name: limit
-- version: 2
-- summary: Set or clear a queue's limits for all its consumers together: most messages in flight, most deliveries per second, minute or hour.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages (decides whether to wake a consumer)
--   delayed  ZSET    P delayed:{Q}         delayed messages (decides whether to wake a consumer)
--   index    ZSET    P messages_index:{Q}  not read
--   meta     HASH    P meta:{Q}            the queue's record; 'limits' = 'IN_FLIGHT RATE' ('-' for unset; RATE is N/s, N/m or N/h) is set or removed here, and the rate's bucket 'limit_tat' removed when the rate changes; 'paused' is read
--   dead     STREAM  P dead:{Q}            not read
--   message  HASH    P message:{Q}         not read
--   state    HASH    P state:{Q}           not read
--   wake     LIST    P wake:{Q}            the wake token, pushed when a change may let a consumer take what is queued; it expires with meta (x-expires)
-- ARGV:
--   1  in_flight  integer 1..1000000, 'clear', or '' (left as it is)             most messages of the queue delivered and not yet acked, across all consumers
--   2  rate       N/s, N/m or N/h with N 1..1000000, 'clear', or '' (left as it is)  most deliveries per second, minute or hour, across all consumers
-- returns: array {in_flight, rate}: the limits in force after the call, '' for none
-- errors:
--   ERR celery-redis-lua: limit: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: limit: expected 2 arguments (in_flight, rate), got N
--   ERR celery-redis-lua: limit: in_flight must be an integer in 1..1000000, 'clear' or '', got 'V'
--   ERR celery-redis-lua: limit: rate must be N/s, N/m or N/h with N an integer in 1..1000000, 'clear' or '', got 'V'
--   ERR celery-redis-lua: limit: nothing to change: in_flight and rate are both ''
--   ERR celery-redis-lua: limit: no queue 'K' (no such meta hash: never declared, deleted or expired)
-- why: Celery's rate_limit and concurrency are per worker, so ten workers run ten times
--   either. These limits are data in the queue's own slot, like a pause: they hold for
--   every consumer at once and for workers started later, survive a restart (AOF) and a
--   failover, and go with the queue; consume enforces them in the call that takes, so the
--   cap is exact however many consumers there are. They change at any time, unlike x-
--   arguments. The rate is a token bucket (GCRA) of burst max(1, N / 10); a new rate starts
--   with a full bucket (the same rate again keeps the bucket). Any change but a lower cap pushes the wake token when something is
--   queued and the queue is not paused, so a consumer the old limit held back looks again.

local rcall = redis.call

-- A consumer with nothing to do blocks on the wake list (BLPOP); a token there wakes one,
-- which runs consume. Pushed only into an empty list: one LLEN while a token already waits.
local function arm_wake(wake_key)
  if redis.call('LLEN', wake_key) > 0 then return false end
  redis.call('RPUSH', wake_key, '1')
  return true
end

-- A wake list made here expires with the queue (x-expires): at meta's expiry time, which
-- all of the queue's keys share; not refreshed, as an operator's change is no consumer's
-- activity.
local function expire_with_meta(meta_key, key)
  local at = redis.call('PEXPIRETIME', meta_key)
  if at > 0 then redis.call('PEXPIREAT', key, at) end
end

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: limit: ' .. message)
end

local MAX = 1000000

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
if #ARGV ~= 2 then return fail('expected 2 arguments (in_flight, rate), got ' .. #ARGV) end
local in_flight, rate = ARGV[1], ARGV[2]
if in_flight ~= '' and in_flight ~= 'clear' then
  local n = string.match(in_flight, '^%d+$') and tonumber(in_flight)
  if not n or n < 1 or n > MAX then
    return fail("in_flight must be an integer in 1..1000000, 'clear' or '', got '" .. in_flight .. "'")
  end
  in_flight = string.format('%d', n) -- '007' is stored as 7
end
if rate ~= '' and rate ~= 'clear' then
  local n, unit = string.match(rate, '^(%d+)/([smh])$')
  n = n and tonumber(n)
  if not n or n < 1 or n > MAX then
    return fail("rate must be N/s, N/m or N/h with N an integer in 1..1000000, 'clear' or '', got '" .. rate .. "'")
  end
  rate = string.format('%d', n) .. '/' .. unit
end
if in_flight == '' and rate == '' then return fail("nothing to change: in_flight and rate are both ''") end
local meta_key = KEYS[4]
if rcall('EXISTS', meta_key) == 0 then
  return fail("no queue '" .. meta_key .. "' (no such meta hash: never declared, deleted or expired)")
end

-- Both limits live in one field, 'limits' = 'IN_FLIGHT RATE' ('-' for unset), so that the
-- scripts on every delivery and ack read one field, not two; the rate's bucket is its own.
local old = rcall('HMGET', meta_key, 'limits', 'paused')
local old_cap, old_rate = string.match(old[1] or '- -', '^(%S+) (%S+)$')
old_cap, old_rate = old_cap or '-', old_rate or '-'
local cap = in_flight == 'clear' and '-' or in_flight == '' and old_cap or in_flight
local new_rate = rate == 'clear' and '-' or rate == '' and old_rate or rate
-- Loosened: a cap gone or raised, or a new rate (it starts with a full bucket).
local loosened = (old_cap ~= '-' and (cap == '-' or tonumber(cap) > tonumber(old_cap))) or new_rate ~= old_rate
if cap == '-' and new_rate == '-' then
  rcall('HDEL', meta_key, 'limits')
else
  rcall('HSET', meta_key, 'limits', cap .. ' ' .. new_rate)
end
if new_rate ~= old_rate then
  rcall('HDEL', meta_key, 'limit_tat') -- a full bucket: an old slow rate's wait does not carry over
end
if loosened and not old[2] and rcall('ZCARD', KEYS[1]) + rcall('ZCARD', KEYS[2]) > 0 and arm_wake(KEYS[8]) then
  expire_with_meta(meta_key, KEYS[8])
end
return {cap == '-' and '' or cap, new_rate == '-' and '' or new_rate}
