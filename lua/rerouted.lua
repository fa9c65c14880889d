#!lua
-- name: rerouted
-- version: 1
-- summary: Record in a queue's meta that an exchange's bindings to it changed, at a time of the binding table's server.
-- KEYS: 1
--   meta     HASH    P meta:{Q}   queue arguments and last_id; 'route:<exchange>' -> unix ms of the last binding change
-- ARGV:
--   1  exchange    string, non-empty   the exchange whose bindings changed
--   2  changed_ms  integer >= 0        the binding table server's unix ms at or after the change (what lookup returned)
-- returns: integer, 1 if the record moved forward, 0 if it already held that time or a later one, or the queue does not exist
-- errors:
--   ERR celery-redis-lua: rerouted: expected 1 key (meta), got N
--   ERR celery-redis-lua: rerouted: expected 2 arguments (exchange, changed_ms), got N
--   ERR celery-redis-lua: rerouted: exchange is missing or empty
--   ERR celery-redis-lua: rerouted: changed_ms must be a non-negative integer, got 'V'
-- why: producers cache an exchange's binding table (a lookup round trip less per publish).
--   Whoever binds or unbinds runs this on every queue the change concerns before it
--   returns, and publish refuses a route looked up before it, so a cached route is never
--   used after an unbind returns. The time is the binding table's clock (passed in), not
--   this queue's server: on a cluster they are different servers. Nothing is created for a
--   queue that does not exist (meta is what makes a queue exist); publish treats a missing
--   meta as a changed route.

local rcall = redis.call

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: rerouted: ' .. message)
end

if #KEYS ~= 1 then return fail('expected 1 key (meta), got ' .. #KEYS) end
if #ARGV ~= 2 then return fail('expected 2 arguments (exchange, changed_ms), got ' .. #ARGV) end
if ARGV[1] == '' then return fail('exchange is missing or empty') end
if not string.match(ARGV[2], '^%d+$') then
  return fail("changed_ms must be a non-negative integer, got '" .. ARGV[2] .. "'")
end
local field = 'route:' .. ARGV[1]
local recorded = rcall('HMGET', KEYS[1], 'last_id', field)
if not recorded[1] then return 0 end
if recorded[2] and tonumber(recorded[2]) >= tonumber(ARGV[2]) then return 0 end
rcall('HSET', KEYS[1], field, ARGV[2])
return 1
