#!lua
-- name: fanout_bind
-- version: 3
-- summary: Give a queue bound to a fanout exchange its own consumer group on the exchange's stream, and clear out expired groups and idle consumers.
-- KEYS: 2
--   stream   STREAM  P /<db>.<exchange>            fanout messages; entry fields 'payload', 'routing_key'
--   groups   HASH    {P /<db>.<exchange>}:groups   bound queue -> 'ACTIVE_AT EXPIRES TTL' (unix ms, ms, ms; '-' for none)
-- ARGV:
--   1  queue              string, non-empty    the bound queue; it names the consumer group
--   2  expires_ms         integer 1..315360000000 or ''  x-expires of the queue: its group expires after this long without a consumer
--   3  message_ttl_ms     integer 1..315360000000 or ''  x-message-ttl of the queue: entries older than this are not delivered to it
--   4  stream_expires_ms  integer 1..315360000000 or ''  the stream expires after this long without a publish, bind or read; '' means never
-- returns: array {created, groups_removed, consumers_removed}: created is 1 when the queue's
--   group was made now (at the stream's end), 0 when it existed and is kept
-- errors:
--   ERR celery-redis-lua: fanout_bind: expected 2 keys (stream, groups), got N
--   ERR celery-redis-lua: fanout_bind: expected 4 arguments, got N
--   ERR celery-redis-lua: fanout_bind: queue is missing or empty
--   ERR celery-redis-lua: fanout_bind: NAME must be an integer in 1..315360000000 or empty, got 'V'
-- why: the group starts at the stream's end when the queue is bound, so the queue receives
--   every entry published after it was bound (as with AMQP), even when its consumer starts
--   later, and a consumer back within x-expires resumes where the group left off. A group
--   whose queue expired (no consumer for x-expires) is gone as the queue would be: bound
--   again, it starts at the end, so a worker restarted under the same name does not run
--   the control commands sent while it was away. Expired groups of other queues, and
--   consumers idle for a minute (entries are acked when read, so none holds anything; a
--   live one is made again by its next read), are removed here, so neither grows with
--   every restart.
--   Durations are at most 10 years (315360000000 ms), as declare takes them.

local rcall = redis.call
local MAX_DURATION_MS = 315360000000 -- 10 years in ms, the longest duration taken or read back (bounds.py)
local IDLE_CONSUMER_MS = 60000

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: fanout_bind: ' .. message)
end

local function optional(index, name)
  if ARGV[index] == '' then return false end
  local n = string.match(ARGV[index], '^%d+$') and tonumber(ARGV[index])
  if not n or n == 0 or n > MAX_DURATION_MS then
    return nil, fail(name .. ' must be an integer in 1..' .. string.format('%d', MAX_DURATION_MS) ..
                     " or empty, got '" .. ARGV[index] .. "'")
  end
  return n
end

if #KEYS ~= 2 then return fail('expected 2 keys (stream, groups), got ' .. #KEYS) end
if #ARGV ~= 4 then return fail('expected 4 arguments, got ' .. #ARGV) end
local stream_key, groups_key, queue = KEYS[1], KEYS[2], ARGV[1]
if queue == '' then return fail('queue is missing or empty') end
local expires, err1 = optional(2, 'expires_ms')
if expires == nil then return err1 end
local ttl, err2 = optional(3, 'message_ttl_ms')
if ttl == nil then return err2 end
local stream_expires, err3 = optional(4, 'stream_expires_ms')
if stream_expires == nil then return err3 end

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

-- 'ACTIVE_AT EXPIRES TTL': expired when nothing read for the queue within EXPIRES.
local function expired(record)
  local active_at, group_expires = string.match(record or '', '^(%d+) (%S+) %S+$')
  group_expires = tonumber(group_expires)
  return active_at ~= nil and group_expires ~= nil and tonumber(active_at) + group_expires < now
end

local groups_removed = 0
local records = rcall('HGETALL', groups_key)
for i = 1, #records, 2 do
  if expired(records[i + 1]) then
    redis.pcall('XGROUP', 'DESTROY', stream_key, records[i])
    rcall('HDEL', groups_key, records[i])
    if records[i] ~= queue then groups_removed = groups_removed + 1 end
  end
end

local created = 0
local made = redis.pcall('XGROUP', 'CREATE', stream_key, queue, '$', 'MKSTREAM')
if type(made) == 'table' and made.err then
  if not string.find(made.err, 'BUSYGROUP', 1, true) then return made end
else
  created = 1
end

local consumers_removed = 0
for _, consumer in ipairs(rcall('XINFO', 'CONSUMERS', stream_key, queue)) do
  local fields = {}
  for i = 1, #consumer, 2 do fields[consumer[i]] = consumer[i + 1] end
  if tonumber(fields.idle) > IDLE_CONSUMER_MS and tonumber(fields.pending) == 0 then
    rcall('XGROUP', 'DELCONSUMER', stream_key, queue, fields.name)
    consumers_removed = consumers_removed + 1
  end
end

rcall('HSET', groups_key, queue, string.format('%d', now) .. ' ' .. (expires or '-') .. ' ' .. (ttl or '-'))
if stream_expires then
  local at = string.format('%d', now + stream_expires) -- one absolute time: they expire together
  rcall('PEXPIREAT', stream_key, at)
  rcall('PEXPIREAT', groups_key, at)
end
return {created, groups_removed, consumers_removed}
