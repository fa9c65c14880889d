#!lua
-- name: declare
-- version: 8
-- summary: Declare a queue: store its arguments (RabbitMQ's x-expires, x-message-ttl, x-max-priority, x-delayed-retry-*, x-consumer-timeout) or check them against the stored ones, record a fanout exchange it is bound to, and refresh its expiry.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments, last_id and 'fanout:<exchange>' -> 1 per fanout binding; it is what makes a queue exist
--   dead     STREAM  P dead:{Q}            dead letters (expiry refresh only)
--   message  HASH    P message:{Q}         id -> payload (counted; expiry refresh)
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]' (expiry refresh only)
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (expiry refresh only)
-- ARGV:
--   1  expires_ms       integer 1..315360000000 or ''  x-expires: the queue's keys expire after this long without a publish, declare or consumer; floor 10000
--   2  message_ttl_ms   integer 1..315360000000 or ''  x-message-ttl: messages expire after waiting this long (per-message TTLs can only shorten it)
--   3  max_priority     integer 0..255 or ''  x-max-priority: priorities above it are delivered as it
--   4  fanout_exchange  string, optional      a fanout exchange the queue is bound to, recorded in meta so that delete names it; '' or absent: none
--   5  retry_type       string, optional      x-delayed-retry-type: 'disabled', 'all', 'failed' or 'returned'; '' or absent: not set
--   6  retry_min_ms     integer 1..315360000000 or ''  x-delayed-retry-min: the first retry's delay; required with a type other than 'disabled'
--   7  retry_max_ms     integer 1..315360000000 or ''  x-delayed-retry-max: the longest delay (10 years when empty); at least retry_min_ms
--   8  consumer_timeout_ms  integer 1..315360000000 or '', optional  x-consumer-timeout: how long a worker keeps one delivery alive (its keeper stops extending it then, and the sweep takes it back)
-- returns: array {ready, delayed, in_flight, expires_ms, message_ttl_ms, max_priority, retry_type,
--   retry_min_ms, retry_max_ms, out_of_range, consumer_timeout_ms}: message counts (in_flight is approximate: messages stored
--   minus ready and delayed), the arguments now in force (-1, or 'disabled' for the type, where not
--   set), and an array of 'x-name=VALUE' for each stored argument out of range (left by an older
--   version or by hand): in force as its bound when past it, as not set when no number
-- errors:
--   ERR celery-redis-lua: declare: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: declare: expected 3, 4, 7 or 8 arguments, got N
--   ERR celery-redis-lua: declare: expires_ms must be an integer in 1..315360000000 or empty, got 'V'
--   ERR celery-redis-lua: declare: message_ttl_ms must be an integer in 1..315360000000 or empty, got 'V'
--   ERR celery-redis-lua: declare: max_priority must be an integer in 0..255 or empty, got 'V'
--   ERR celery-redis-lua: declare: retry_type must be 'disabled', 'all', 'failed', 'returned' or empty, got 'V'
--   ERR celery-redis-lua: declare: retry_min_ms must be an integer in 1..315360000000 or empty, got 'V'
--   ERR celery-redis-lua: declare: retry_max_ms must be an integer in 1..315360000000 or empty, got 'V'
--   ERR celery-redis-lua: declare: consumer_timeout_ms must be an integer in 1..315360000000 or empty, got 'V'
--   ERR celery-redis-lua: declare: x-delayed-retry-type 'T' needs x-delayed-retry-min
--   ERR celery-redis-lua: declare: x-delayed-retry-max V is below x-delayed-retry-min M
--   ERR celery-redis-lua: declare: queue 'Q' was declared with other arguments: x-expires stored 10000, declared 20000; ... (delete the queue to change them)
-- why: arguments live in the broker, as with RabbitMQ, so that producers in any language
--   get the same TTL and priority cap without knowing them. As with RabbitMQ, a queue's
--   arguments do not change once set: a declaration with other arguments is refused with
--   the difference named, and one without arguments (a producer's) keeps the stored ones.
--   A queue whose arguments were never set (created by a publish) takes the first ones
--   declared. A queue bound to a fanout exchange has a consumer group on the exchange's
--   stream, which is in another cluster slot; the binder declares the queue again with the
--   exchange (before it creates the group), so the binding is known in the queue's own
--   slot and deleting the queue from any connection can remove the group too. The
--   delayed-retry arguments follow RabbitMQ 4.3's quorum queues; reject and sweep read them
--   (a type of 'disabled' is stored as not set). Durations are at most 10 years (315360000000
--   ms): every script adds them to the clock, and sums must stay exact doubles and below 10^13
--   ms (a ready score's priority band). Stored arguments are read with the same bounds: one
--   past its bound counts as the bound here and in every script that reads it (a 10^19 ms
--   retry_min waits 10 years), and is named in the reply, so a declare without arguments
--   still works, and one with arguments is refused naming it ("x-delayed-retry-min stored 'V'
--   (out of range), declared 1000"; delete the queue to set them again). x-consumer-timeout
--   is RabbitMQ's (ms): no script but declare reads it; the workers' keepers do, from the reply.

local rcall = redis.call
local MIN_EXPIRES_MS = 10000
local MAX_DURATION_MS = 315360000000 -- 10 years in ms, the longest duration taken or read back (bounds.py)
local NAMES = {'expires', 'message_ttl', 'max_priority', 'retry_type', 'retry_min', 'retry_max', 'consumer_timeout'}
local AMQP_NAMES = {expires = 'x-expires', message_ttl = 'x-message-ttl', max_priority = 'x-max-priority',
                    retry_type = 'x-delayed-retry-type', retry_min = 'x-delayed-retry-min',
                    retry_max = 'x-delayed-retry-max', consumer_timeout = 'x-consumer-timeout'}
local RETRY_TYPES = {disabled = true, all = true, failed = true, returned = true}
-- The range of each numeric argument, declared (ARGV) or stored (meta) alike.
local DURATION = {1, MAX_DURATION_MS, 'an integer in 1..' .. string.format('%d', MAX_DURATION_MS)}
local RANGES = {expires = DURATION, message_ttl = DURATION, max_priority = {0, 255, 'an integer in 0..255'},
                retry_min = DURATION, retry_max = DURATION, consumer_timeout = DURATION}

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: declare: ' .. message)
end

local function optional(value, name, range)
  if value == '' then return false end
  local n = string.match(value, '^%d+$') and tonumber(value)
  if not n or n < range[1] or n > range[2] then
    return nil, name .. ' must be ' .. range[3] .. ' or empty, got \'' .. value .. "'"
  end
  return n
end

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
if #ARGV ~= 3 and #ARGV ~= 4 and #ARGV ~= 7 and #ARGV ~= 8 then
  return fail('expected 3, 4, 7 or 8 arguments, got ' .. #ARGV)
end
local expires, err1 = optional(ARGV[1], 'expires_ms', RANGES.expires)
if expires == nil then return fail(err1) end
local ttl, err2 = optional(ARGV[2], 'message_ttl_ms', RANGES.message_ttl)
if ttl == nil then return fail(err2) end
local max_priority, err3 = optional(ARGV[3], 'max_priority', RANGES.max_priority)
if max_priority == nil then return fail(err3) end
local retry_type = ARGV[5] or ''
if retry_type ~= '' and not RETRY_TYPES[retry_type] then
  return fail("retry_type must be 'disabled', 'all', 'failed', 'returned' or empty, got '" .. retry_type .. "'")
end
local retry_min, err5 = optional(ARGV[6] or '', 'retry_min_ms', RANGES.retry_min)
if retry_min == nil then return fail(err5) end
local retry_max, err6 = optional(ARGV[7] or '', 'retry_max_ms', RANGES.retry_max)
if retry_max == nil then return fail(err6) end
local consumer_timeout, err8 = optional(ARGV[8] or '', 'consumer_timeout_ms', RANGES.consumer_timeout)
if consumer_timeout == nil then return fail(err8) end
if retry_type == 'disabled' or retry_type == '' then
  retry_type, retry_min, retry_max = false, false, false -- disabled is the default: nothing stored
elseif not retry_min then
  return fail("x-delayed-retry-type '" .. retry_type .. "' needs x-delayed-retry-min")
elseif retry_max and retry_max < retry_min then
  return fail('x-delayed-retry-max ' .. retry_max .. ' is below x-delayed-retry-min ' .. retry_min)
end

local meta_key = KEYS[4]
local declared = {expires = expires and math.max(expires, MIN_EXPIRES_MS), message_ttl = ttl,
                  max_priority = max_priority, retry_type = retry_type, retry_min = retry_min,
                  retry_max = retry_max, consumer_timeout = consumer_timeout}
-- Stored arguments pass the same checks as declared ones. One out of range (an older
-- version's, or set by hand) is named in `out_of_range`; in force, as every script reads it,
-- past its bound it counts as the bound (never added to the clock past 10 years:
-- string.format('%d') overflows past 2^63), and one that is no number counts as not set.
local raw = rcall('HMGET', meta_key, unpack(NAMES))
local stored, out_of_range = {}, {}
for i, name in ipairs(NAMES) do
  local value = raw[i]
  if value and name == 'retry_type' then
    if RETRY_TYPES[value] and value ~= 'disabled' then
      stored[name] = value
    else
      out_of_range[name] = value
    end
  elseif value then
    local n = string.match(value, '^%d+$') and tonumber(value)
    if n and n >= RANGES[name][1] then stored[name] = math.min(n, RANGES[name][2]) end
    if not n or n < RANGES[name][1] or n > RANGES[name][2] then out_of_range[name] = value end
  end
end
local any_declared, any_stored = false, false
for _, name in ipairs(NAMES) do
  any_declared = any_declared or declared[name]
  any_stored = any_stored or stored[name] or out_of_range[name]
end

if any_declared and any_stored then
  local differences = {}
  for _, name in ipairs(NAMES) do
    if out_of_range[name] then -- refused even where its bound is what is declared: delete the queue
      differences[#differences + 1] = AMQP_NAMES[name] .. " stored '" .. out_of_range[name] ..
        "' (out of range), declared " .. tostring(declared[name] or 'none')
    elseif (declared[name] or nil) ~= stored[name] then
      differences[#differences + 1] = AMQP_NAMES[name] .. ' stored ' .. tostring(stored[name] or 'none') ..
        ', declared ' .. tostring(declared[name] or 'none')
    end
  end
  if #differences > 0 then
    local queue = string.match(KEYS[1], '{(.-)}') or KEYS[1]
    return fail("queue '" .. queue .. "' was declared with other arguments: " .. table.concat(differences, '; ') ..
                ' (delete the queue to change them)')
  end
elseif any_declared then
  for _, name in ipairs(NAMES) do
    if declared[name] then rcall('HSET', meta_key, name, declared[name]) end
  end
  stored = declared
end
rcall('HSETNX', meta_key, 'last_id', '0000000000000000') -- ids follow the clock from here -- the queue exists from now on, even while empty
local fanout_exchange = ARGV[4] or ''
if fanout_exchange ~= '' then rcall('HSET', meta_key, 'fanout:' .. fanout_exchange, 1) end

if stored.expires then
  local time = rcall('TIME')
  local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
  local at = string.format('%d', now + stored.expires) -- one absolute time: the keys expire together
  for i = 1, 8 do rcall('PEXPIREAT', KEYS[i], at) end
end

-- The delayed retry in force, as reject and sweep read it (retry_policy): a type with a
-- retry_min; a retry_max below it (only a clamped or hand-set retry_min can be) makes every
-- delay retry_max, which is what reporting retry_min as retry_max says.
local named = {}
for _, name in ipairs(NAMES) do
  if out_of_range[name] then named[#named + 1] = AMQP_NAMES[name] .. '=' .. out_of_range[name] end
end
if stored.retry_type and not stored.retry_min then
  if not out_of_range.retry_min then named[#named + 1] = 'x-delayed-retry-min=none' end
  stored.retry_type = false
end
if not stored.retry_type then
  stored.retry_min, stored.retry_max = false, false
elseif stored.retry_max and stored.retry_max < stored.retry_min then
  stored.retry_min = stored.retry_max
end

local ready, delayed = rcall('ZCARD', KEYS[1]), rcall('ZCARD', KEYS[2])
return {ready, delayed, math.max(0, rcall('HLEN', KEYS[6]) - ready - delayed),
        stored.expires or -1, stored.message_ttl or -1, stored.max_priority or -1,
        stored.retry_type or 'disabled', stored.retry_min or -1, stored.retry_max or -1, named,
        stored.consumer_timeout or -1}
