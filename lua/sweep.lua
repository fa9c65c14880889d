#!lua flags=allow-oom
-- name: sweep
-- version: 1
-- summary: Periodic repair of queues: promote due delayed messages, restore timed-out deliveries, dead-letter what reached the delivery limit, drop orphans.
-- KEYS: 4 per queue, repeated for each queue (all queues of one call must share a cluster slot)
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages, score = ETA in unix ms
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   dead     STREAM  P dead:{Q}            dead letters: id, reason, delivery_count, priority, payload
-- ARGV:
--   1  message_key_prefix  string         P message: ; the hash is prefix .. '{Q}:' .. id
--   2  visibility_ms       integer > 0    deadline given to restored and rescheduled entries
--   3  delivery_limit      integer >= 0   delivery attempts before a message is dead-lettered; 0 means no limit
--   4  dead_letter_maxlen  integer >= 0   approximate cap of the dead-letter stream; 0 deletes dropped messages outright
--   5  batch               integer 1..10000  most entries looked at per queue and per kind in this call
--   6  report_limit        integer >= 0   most dropped messages returned with their payload
-- returns: array {promoted, requeued, unclaimed, backlog, dead_lettered, orphans, more,
--   then 4 items per reported dropped message: queue_position, id, delivery_count, payload}
--   promoted: delayed messages made ready; requeued: timed-out deliveries put back (count + 1);
--   unclaimed: messages popped by BZMPOP but never claimed, put back (not counted);
--   backlog: ready messages still queued whose index entry was pushed forward (not counted);
--   more: 1 when a batch was full, so the caller should sweep again.
-- errors:
--   ERR celery-redis-lua: sweep: expected 4 keys per queue, got N
--   ERR celery-redis-lua: sweep: expected 6 arguments, got N
--   ERR celery-redis-lua: sweep: key 'K' has no {hash tag}
--   ERR celery-redis-lua: sweep: NAME must be ... , got 'V'
-- why: an index entry that falls due means one of four things, told apart by the hash's
--   state and the queue: the message still waits in the queue (backlog: reschedule the
--   check, backing off with its age so a large backlog costs little), it was popped but
--   never claimed (restore, not a delivery), it was delivered and not acked in time
--   (restore with delivery_count + 1, or dead-letter at the limit), or its hash is gone
--   (orphan: remove the entry). allow-oom, because the sweep mostly frees memory.

local rcall = redis.call
local PRIORITY_FACTOR = 10000000000000

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: sweep: ' .. message)
end

local function natural(value)
  if not string.match(value, '^%d+$') then return nil end
  return tonumber(value)
end

if #KEYS == 0 or #KEYS % 4 ~= 0 then return fail('expected 4 keys per queue, got ' .. #KEYS) end
if #ARGV ~= 6 then return fail('expected 6 arguments, got ' .. #ARGV) end
local visibility = natural(ARGV[2])
if not visibility or visibility == 0 then
  return fail("visibility_ms must be a positive integer, got '" .. ARGV[2] .. "'")
end
local limit = natural(ARGV[3])
if not limit then return fail("delivery_limit must be an integer >= 0, got '" .. ARGV[3] .. "'") end
local dead_maxlen = natural(ARGV[4])
if not dead_maxlen then return fail("dead_letter_maxlen must be an integer >= 0, got '" .. ARGV[4] .. "'") end
local batch = natural(ARGV[5])
if not batch or batch < 1 or batch > 10000 then
  return fail("batch must be an integer in 1..10000, got '" .. ARGV[5] .. "'")
end
local report_limit = natural(ARGV[6])
if not report_limit then return fail("report_limit must be an integer >= 0, got '" .. ARGV[6] .. "'") end

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local deadline = string.format('%d', now + visibility)

local function ready_score(priority, ready_at)
  return string.format('%d', (255 - priority) * PRIORITY_FACTOR + ready_at)
end

-- Validate every queue key before the first write, so bad input changes nothing.
local message_prefixes = {}
for q = 1, #KEYS / 4 do
  local brace = string.find(KEYS[4 * q - 3], '{', 1, true)
  if not brace then return fail("key '" .. KEYS[4 * q - 3] .. "' has no {hash tag}") end
  message_prefixes[q] = ARGV[1] .. string.sub(KEYS[4 * q - 3], brace) .. ':'
end

local promoted, requeued, unclaimed, backlog, dead_lettered, orphans, more = 0, 0, 0, 0, 0, 0, 0
local reported = {}

for q = 1, #KEYS / 4 do
  local queue_key, delayed_key, index_key, dead_key = KEYS[4 * q - 3], KEYS[4 * q - 2], KEYS[4 * q - 1], KEYS[4 * q]
  local message_prefix = message_prefixes[q]

  local due = rcall('ZRANGE', delayed_key, '-inf', now, 'BYSCORE', 'LIMIT', 0, batch, 'WITHSCORES')
  for i = 1, #due, 2 do
    local id, eta = due[i], tonumber(due[i + 1])
    local message_key = message_prefix .. id
    local priority = tonumber(rcall('HGET', message_key, 'priority'))
    if priority then
      rcall('ZADD', queue_key, ready_score(priority, eta), id)
      rcall('ZADD', index_key, deadline, id)
      rcall('HSET', message_key, 'state', 'ready')
      promoted = promoted + 1
    else
      orphans = orphans + 1
    end
    rcall('ZREM', delayed_key, id)
  end
  if #due == 2 * batch then more = 1 end
  if #due > 0 and rcall('ZCARD', delayed_key) == 0 then
    rcall('ZREM', queue_key, '~wake') -- the wake marker lives only while something is delayed
  end

  local entries = rcall('ZRANGE', index_key, '-inf', now, 'BYSCORE', 'LIMIT', 0, batch)
  for _, id in ipairs(entries) do
    local message_key = message_prefix .. id
    local message = rcall('HMGET', message_key, 'payload', 'priority', 'delivery_count', 'state')
    local queued_score = rcall('ZSCORE', queue_key, id)
    if not message[1] then
      rcall('ZREM', index_key, id)
      rcall('ZREM', queue_key, id)
      orphans = orphans + 1
    elseif queued_score then
      local waited = now - (tonumber(queued_score) % PRIORITY_FACTOR)
      rcall('ZADD', index_key, string.format('%d', now + math.max(visibility, waited)), id)
      backlog = backlog + 1
    elseif message[4] ~= 'unacked' then
      rcall('ZADD', queue_key, ready_score(tonumber(message[2]) or 0, now), id)
      rcall('ZADD', index_key, deadline, id)
      rcall('HSET', message_key, 'state', 'ready')
      unclaimed = unclaimed + 1
    else
      local priority = tonumber(message[2]) or 0
      local attempts = (tonumber(message[3]) or 0) + 1
      if limit == 0 or attempts < limit then
        rcall('HSET', message_key, 'delivery_count', attempts, 'state', 'ready')
        rcall('ZADD', queue_key, ready_score(priority, now), id)
        rcall('ZADD', index_key, deadline, id)
        requeued = requeued + 1
      else
        if dead_maxlen > 0 then
          rcall('XADD', dead_key, 'MAXLEN', '~', dead_maxlen, '*', 'id', id, 'reason', 'delivery-limit',
                'delivery_count', attempts, 'priority', priority, 'payload', message[1])
        end
        rcall('DEL', message_key)
        rcall('ZREM', index_key, id)
        dead_lettered = dead_lettered + 1
        if #reported < 4 * report_limit then
          reported[#reported + 1] = q
          reported[#reported + 1] = id
          reported[#reported + 1] = attempts
          reported[#reported + 1] = message[1]
        end
      end
    end
  end
  if #entries == batch then more = 1 end
end

local reply = {promoted, requeued, unclaimed, backlog, dead_lettered, orphans, more}
for _, item in ipairs(reported) do reply[#reply + 1] = item end
return reply
