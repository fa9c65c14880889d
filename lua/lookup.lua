#!lua flags=allow-oom
-- name: lookup
-- version: 3
-- summary: List the live bindings of an exchange, pruning those that went stale.
-- KEYS: 1
--   table    ZSET    P binding:<exchange>           member routing_key SEP pattern SEP queue -> stale-at unix ms
-- ARGV: none
-- returns: array: the server's unix ms now (as a string), the ms until the first live member goes stale
--   (-1: none ever does), then the members (routing_key SEP pattern SEP queue), stalest first
-- errors:
--   ERR celery-redis-lua: lookup: expected 1 key (binding table), got N
-- why: pruning here, by the server's clock, means a producer never routes to a queue
--   whose binding expired even if nobody swept. The time and the lifetime are for a
--   producer that caches the table: it keeps it no longer than the first member lives, and
--   publish refuses a route looked up before the last binding change of its queue
--   (see rerouted). allow-oom, because it only removes.

local rcall = redis.call

if #KEYS ~= 1 then
  return redis.error_reply('ERR celery-redis-lua: lookup: expected 1 key (binding table), got ' .. #KEYS)
end
local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
rcall('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now))
local live = rcall('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES') -- stalest first
local reply = {string.format('%d', now), -1}
if live[2] and live[2] ~= 'inf' then reply[2] = math.max(0, tonumber(live[2]) - now) end
for i = 1, #live, 2 do reply[#reply + 1] = live[i] end
return reply
