#!lua
-- name: fanout_consume
-- version: 1
-- summary: Take the next entries of a fanout stream for one bound queue (its consumer group), acknowledged at once.
-- KEYS: 1
--   stream   STREAM  P /<db>.<exchange>   fanout messages; entry fields 'payload', 'routing_key'
-- ARGV:
--   1  queue     string, non-empty    the bound queue (the consumer group)
--   2  consumer  string, non-empty    a name for this consumer within the group
--   3  count     integer 1..10000     most entries returned
-- returns: array {last_id, then 3 items per entry: entry_id, routing_key, payload}
--   last_id is the id of the stream's newest entry ('0-0' when it has none): block on XREAD
--   after it to wake up exactly when something new arrives.
-- errors:
--   ERR celery-redis-lua: fanout_consume: expected 1 key (stream), got N
--   ERR celery-redis-lua: fanout_consume: expected 3 arguments, got N
--   ERR celery-redis-lua: fanout_consume: queue and consumer must be non-empty
--   ERR celery-redis-lua: fanout_consume: count must be an integer in 1..10000, got 'V'
-- why: broadcasts (Celery remote control, broadcast queues) are delivered at most once per
--   bound queue: entries are acknowledged as they are read, so the group keeps no pending
--   list. A queue without a group (its binding expired) gets one starting now.

local rcall = redis.call

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: fanout_consume: ' .. message)
end

if #KEYS ~= 1 then return fail('expected 1 key (stream), got ' .. #KEYS) end
if #ARGV ~= 3 then return fail('expected 3 arguments, got ' .. #ARGV) end
if ARGV[1] == '' or ARGV[2] == '' then return fail('queue and consumer must be non-empty') end
local count = string.match(ARGV[3], '^%d+$') and tonumber(ARGV[3])
if not count or count < 1 or count > 10000 then
  return fail("count must be an integer in 1..10000, got '" .. ARGV[3] .. "'")
end

local reply = {'0-0'}
local read = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', count, 'STREAMS', KEYS[1], '>')
if type(read) == 'table' and read.err then
  if string.find(read.err, 'NOGROUP', 1, true) then
    rcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '$', 'MKSTREAM')
    read = false
  else
    return read
  end
end
if read then
  local ids = {}
  for _, entry in ipairs(read[1][2]) do
    local fields = {}
    for i = 1, #entry[2], 2 do fields[entry[2][i]] = entry[2][i + 1] end
    reply[#reply + 1] = entry[1]
    reply[#reply + 1] = fields.routing_key or ''
    reply[#reply + 1] = fields.payload or ''
    ids[#ids + 1] = entry[1]
  end
  if #ids > 0 then rcall('XACK', KEYS[1], ARGV[1], unpack(ids)) end
end
local last = rcall('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
if last[1] then reply[1] = last[1][1] end
return reply
