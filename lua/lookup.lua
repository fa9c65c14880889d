#!lua flags=allow-oom
-- name: lookup
-- version: 2
-- summary: List the live bindings of an exchange, pruning those that went stale.
-- KEYS: 1
--   table    ZSET    P binding:<exchange>           member routing_key SEP pattern SEP queue -> stale-at unix ms
-- ARGV: none
-- returns: array of members (routing_key SEP pattern SEP queue), in member order
-- errors:
--   ERR celery-redis-lua: lookup: expected 1 key (binding table), got N
-- why: pruning here, by the server's clock, means a producer never routes to a queue
--   whose binding expired even if nobody swept. allow-oom, because it only removes.

local rcall = redis.call

if #KEYS ~= 1 then
  return redis.error_reply('ERR celery-redis-lua: lookup: expected 1 key (binding table), got ' .. #KEYS)
end
local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
rcall('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now))
return rcall('ZRANGE', KEYS[1], 0, -1)
