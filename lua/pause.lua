#!lua
-- name: pause
-- version: 1
-- summary: Pause a queue: it keeps taking publishes and delivers nothing to anyone until resumed.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages (not touched: they wait)
--   delayed  ZSET    P delayed:{Q}         delayed messages (not touched: due ones wait too)
--   index    ZSET    P messages_index:{Q}  not read (messages in flight finish normally)
--   meta     HASH    P meta:{Q}            the queue's record; 'paused' = '<unix ms> <reason>' is set here
--   dead     STREAM  P dead:{Q}            not read
--   message  HASH    P message:{Q}         not read
--   state    HASH    P state:{Q}           not read
--   wake     LIST    P wake:{Q}            the wake token: deleted, so no blocked consumer wakes for the queue
-- ARGV:
--   1  reason  string, at most 256 bytes, may be empty   why, for whoever reads status or the meta hash
-- returns: integer, 1 when the queue was running, 0 when it was paused already (the reason is replaced)
-- errors:
--   ERR celery-redis-lua: pause: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: pause: expected 1 argument (reason), got N
--   ERR celery-redis-lua: pause: reason must be at most 256 bytes, got N
--   ERR celery-redis-lua: pause: no queue 'K' (no such meta hash: never declared, deleted or expired)
-- why: the pause is data in the queue's own slot, so it holds for every consumer at once,
--   for workers started later, and across a restart (AOF) or a failover, unlike a worker's
--   cancel_consumer. consume reads the flag in the same call that would take messages, so
--   no delivery races it; publish skips the wake token of a paused queue. Nothing else
--   changes: publishes are stored, countdowns wait, in-flight messages are acked as usual.

local rcall = redis.call

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: pause: ' .. message)
end

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
if #ARGV ~= 1 then return fail('expected 1 argument (reason), got ' .. #ARGV) end
if #ARGV[1] > 256 then return fail('reason must be at most 256 bytes, got ' .. #ARGV[1]) end
if rcall('EXISTS', KEYS[4]) == 0 then
  return fail("no queue '" .. KEYS[4] .. "' (no such meta hash: never declared, deleted or expired)")
end

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local was = rcall('HEXISTS', KEYS[4], 'paused')
rcall('HSET', KEYS[4], 'paused', string.format('%d', now) .. ' ' .. ARGV[1])
rcall('DEL', KEYS[8])
return 1 - was
