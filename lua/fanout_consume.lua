#!lua
-- name: fanout_consume
-- version: 3
-- summary: Take the next entries of a fanout stream for one bound queue (its consumer group), acknowledged at once.
-- KEYS: 2
--   stream   STREAM  P /<db>.<exchange>            fanout messages; entry fields 'payload', 'routing_key'
--   groups   HASH    {P /<db>.<exchange>}:groups   bound queue -> 'ACTIVE_AT EXPIRES TTL' (unix ms, ms, ms; '-' for none)
-- ARGV:
--   1  queue              string, non-empty    the bound queue (the consumer group)
--   2  consumer           string, non-empty    a name for this consumer within the group
--   3  count              integer 1..10000     most entries returned
--   4  stream_expires_ms  integer 1..315360000000 or ''  the stream expires after this long without a publish, bind or read; '' means never
-- returns: array {next_id, skipped, then 3 items per entry: entry_id, routing_key, payload}
--   next_id: block on XREAD after it to wake up exactly when there is more to read (the
--   last entry read when the batch was full, so the rest comes at once; else the stream's
--   newest entry, '0-0' when it has none); skipped counts entries older than the queue's
--   x-message-ttl, read and not returned.
-- errors:
--   ERR celery-redis-lua: fanout_consume: expected 2 keys (stream, groups), got N
--   ERR celery-redis-lua: fanout_consume: expected 4 arguments, got N
--   ERR celery-redis-lua: fanout_consume: queue and consumer must be non-empty
--   ERR celery-redis-lua: fanout_consume: count must be an integer in 1..10000, got 'V'
--   ERR celery-redis-lua: fanout_consume: stream_expires_ms must be an integer in 1..315360000000 or empty, got 'V'
-- why: broadcasts (Celery remote control, broadcast queues, events) are delivered at most
--   once per bound queue: entries are acknowledged as they are read (in chunks, so a batch
--   of any size is acknowledged whole), and the group keeps no pending list. Reading is
--   consumer activity: it keeps the queue's group (and the stream) from expiring. A queue
--   whose group expired, or that has none (its binding expired), gets one starting now:
--   what was sent while it was gone is not delivered, as with an expired AMQP queue.
--   stream_expires_ms is at most 10 years (315360000000 ms): now plus it stays an exact double.

local rcall = redis.call
local MAX_DURATION_MS = 315360000000 -- 10 years in ms, the longest duration taken or read back (bounds.py)

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: fanout_consume: ' .. message)
end

if #KEYS ~= 2 then return fail('expected 2 keys (stream, groups), got ' .. #KEYS) end
if #ARGV ~= 4 then return fail('expected 4 arguments, got ' .. #ARGV) end
local stream_key, groups_key, queue, consumer = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
if queue == '' or consumer == '' then return fail('queue and consumer must be non-empty') end
local count = string.match(ARGV[3], '^%d+$') and tonumber(ARGV[3])
if not count or count < 1 or count > 10000 then
  return fail("count must be an integer in 1..10000, got '" .. ARGV[3] .. "'")
end
local stream_expires = ARGV[4] ~= '' and string.match(ARGV[4], '^%d+$') and tonumber(ARGV[4])
if ARGV[4] ~= '' and (not stream_expires or stream_expires == 0 or stream_expires > MAX_DURATION_MS) then
  return fail("stream_expires_ms must be an integer in 1.." .. string.format('%d', MAX_DURATION_MS) ..
              " or empty, got '" .. ARGV[4] .. "'")
end

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local record = rcall('HGET', groups_key, queue)
local active_at, expires, ttl = string.match(record or '', '^(%d+) (%S+) (%S+)$')
expires, ttl = tonumber(expires), tonumber(ttl)
local reply = {'0-0', 0}
local read = false
if active_at and expires and tonumber(active_at) + expires < now then
  -- The queue expired while nobody read it: it starts again empty, at the stream's end.
  redis.pcall('XGROUP', 'DESTROY', stream_key, queue)
  rcall('XGROUP', 'CREATE', stream_key, queue, '$', 'MKSTREAM')
else
  read = redis.pcall('XREADGROUP', 'GROUP', queue, consumer, 'COUNT', count, 'STREAMS', stream_key, '>')
  if type(read) == 'table' and read.err then
    if not string.find(read.err, 'NOGROUP', 1, true) then return read end
    rcall('XGROUP', 'CREATE', stream_key, queue, '$', 'MKSTREAM')
    read = false
  end
end

local entries = read and read[1][2] or {}
local ids, skipped = {}, 0
for _, entry in ipairs(entries) do
  ids[#ids + 1] = entry[1]
  local published = tonumber(string.match(entry[1], '^(%d+)%-'))
  if ttl and published and published + ttl < now then
    skipped = skipped + 1
  else
    local fields = {}
    for i = 1, #entry[2], 2 do fields[entry[2][i]] = entry[2][i + 1] end
    reply[#reply + 1] = entry[1]
    reply[#reply + 1] = fields.routing_key or ''
    reply[#reply + 1] = fields.payload or ''
  end
end
for first = 1, #ids, 1000 do
  rcall('XACK', stream_key, queue, unpack(ids, first, math.min(first + 999, #ids)))
end
reply[2] = skipped

if #entries == count then
  reply[1] = entries[#entries][1]
else
  local last = rcall('XREVRANGE', stream_key, '+', '-', 'COUNT', 1)
  if last[1] then reply[1] = last[1][1] end
end

rcall('HSET', groups_key, queue, string.format('%d', now) .. ' ' .. (expires or '-') .. ' ' .. (ttl or '-'))
if stream_expires then
  local at = string.format('%d', now + stream_expires) -- one absolute time: they expire together
  rcall('PEXPIREAT', stream_key, at)
  rcall('PEXPIREAT', groups_key, at)
end
return reply
