#!lua
-- name: resume
-- version: 2
-- summary: Resume a paused queue, and wake a blocked consumer at once if anything is queued.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages (decides whether to wake a consumer)
--   delayed  ZSET    P delayed:{Q}         delayed messages (decides whether to wake a consumer)
--   index    ZSET    P messages_index:{Q}  not read
--   meta     HASH    P meta:{Q}            the queue's record; its 'paused' field is removed
--   dead     STREAM  P dead:{Q}            not read
--   message  HASH    P message:{Q}         not read
--   state    HASH    P state:{Q}           not read
--   wake     LIST    P wake:{Q}            the wake token, pushed when something is queued; it expires with meta (x-expires)
-- ARGV: none
-- returns: integer, 1 when the queue was paused, 0 when it was running already
-- errors:
--   ERR celery-redis-lua: resume: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: resume: expected no arguments, got N
--   ERR celery-redis-lua: resume: no queue 'K' (no such meta hash: never declared, deleted or expired)
-- why: consumers of a paused queue block on its wake list with nothing to wake them; the
--   token pushed here wakes one at once (no wait for blocking_timeout), and its consume
--   pushes it again while messages are left, so every blocked consumer gets its share.

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
  return redis.error_reply('ERR celery-redis-lua: resume: ' .. message)
end

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
if #ARGV ~= 0 then return fail('expected no arguments, got ' .. #ARGV) end
if rcall('EXISTS', KEYS[4]) == 0 then
  return fail("no queue '" .. KEYS[4] .. "' (no such meta hash: never declared, deleted or expired)")
end

local was = rcall('HDEL', KEYS[4], 'paused')
if rcall('ZCARD', KEYS[1]) + rcall('ZCARD', KEYS[2]) > 0 and arm_wake(KEYS[8]) then
  expire_with_meta(KEYS[4], KEYS[8])
end
return was
