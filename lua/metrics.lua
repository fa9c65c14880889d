#!lua flags=no-writes
-- name: metrics
-- version: 7
-- summary: What a dashboard shows per queue: counts, the oldest ready message, the next ETA, and the counters.
-- KEYS: 8 per queue, repeated for each queue (all queues of one call must share a cluster slot)
--   queue    ZSET    P queue:{Q}           ready messages (score: priority band + ready time)
--   delayed  ZSET    P delayed:{Q}         delayed messages (score: ETA, unix ms)
--   index    ZSET    P messages_index:{Q}  in-flight messages and ready ones with a TTL (not read)
--   meta     HASH    P meta:{Q}            counters 'redelivered', 'retrying', 'dropped:<reason>' and 'deduplicated:<mode>'; 'paused' (set by pause); 'limits' (set by limit: 'IN_FLIGHT RATE', '-' for unset)
--   dead     STREAM  P dead:{Q}            dead letters
--   message  HASH    P message:{Q}         id -> payload (counted)
--   state    HASH    P state:{Q}           id -> state (not read)
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (not read)
-- ARGV: none
-- returns: array: the server's time (unix ms), then 14 items per queue: ready, delayed,
--   in_flight, dead, oldest_ready_at (unix ms at which the oldest ready message became
--   ready, -1 for none), next_eta (unix ms of the earliest delayed message, -1 for none),
--   redelivered (counter), and an array of reason, count pairs of messages dropped
--   (dead-lettered, or deleted when dead_letter_maxlen is 0) since the queue was created,
--   the 'paused' field ('<unix ms> <reason>', or '' when the queue is not paused), and
--   retrying: how many of the delayed messages wait for a delayed retry (x-delayed-retry-type),
--   the in-flight limit and the rate (from 'limits', as the limit script stored them; '' when unset),
--   and exists: 1 while the queue's meta hash exists (what makes a queue exist), 0 when it
--   does not (its keys expired or were deleted, or nothing declared it): a caller that
--   found the queue earlier learns here that it is gone, and every count is then 0;
--   deduplicated: an array of mode, count pairs of publishes a dedup id dropped (simple,
--   throttle) or messages a newer one replaced (debounce), since the queue was created
-- errors:
--   ERR celery-redis-lua: metrics: expected 8 keys per queue, got N
-- why: one call answers a scrape for a group of queues, from one consistent snapshot.
--   The work is bounded whatever the backlog: the counts are O(1) as in stats; the
--   oldest ready message is the earliest of the head of each priority band present
--   (ready scores sort by band first), found by one O(log N) range per band, at most 256;
--   the next ETA is the head of the delayed set. Counters are kept by reject, sweep,
--   and consume where they redeliver or drop a message.

local rcall = redis.call
local PRIORITY_FACTOR = 10000000000000 -- 10^13 ms per priority level (317 years)
local QUEUE_KEYS = 8

if #KEYS == 0 or #KEYS % QUEUE_KEYS ~= 0 then
  return redis.error_reply('ERR celery-redis-lua: metrics: expected 8 keys per queue, got ' .. #KEYS)
end

-- The earliest ready time among the heads of the priority bands (-1: nothing ready).
local function oldest_ready_at(queue_key)
  local oldest, low = -1, '-inf'
  for _ = 1, 256 do
    local head = rcall('ZRANGE', queue_key, low, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
    if #head == 0 then break end
    local score = tonumber(head[2])
    local band = math.floor(score / PRIORITY_FACTOR)
    local at = score - band * PRIORITY_FACTOR
    if oldest < 0 or at < oldest then oldest = at end
    low = string.format('%d', (band + 1) * PRIORITY_FACTOR) -- the next band's first score
  end
  return oldest
end

local time = rcall('TIME')
local reply = {tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)}
for q = 1, #KEYS / QUEUE_KEYS do
  local base = QUEUE_KEYS * (q - 1)
  local queue_key, meta_key = KEYS[base + 1], KEYS[base + 4]
  local ready, delayed = rcall('ZCARD', queue_key), rcall('ZCARD', KEYS[base + 2])
  local eta = rcall('ZRANGE', KEYS[base + 2], 0, 0, 'WITHSCORES')
  local dropped, deduplicated = {}, {}
  local fields = rcall('HGETALL', meta_key) -- a handful of arguments and counters
  local redelivered, paused, retrying, cap, rate = 0, '', 0, '', ''
  for i = 1, #fields, 2 do
    if fields[i] == 'paused' then
      paused = fields[i + 1]
    elseif fields[i] == 'limits' then
      cap, rate = string.match(fields[i + 1], '^(%S+) (%S+)$')
      if cap == '-' or not cap then cap = '' end
      if rate == '-' or not rate then rate = '' end
    elseif fields[i] == 'redelivered' then
      redelivered = tonumber(fields[i + 1])
    elseif fields[i] == 'retrying' then
      retrying = math.max(0, tonumber(fields[i + 1]))
    elseif string.sub(fields[i], 1, 8) == 'dropped:' then
      dropped[#dropped + 1] = string.sub(fields[i], 9)
      dropped[#dropped + 1] = tonumber(fields[i + 1])
    elseif string.sub(fields[i], 1, 13) == 'deduplicated:' then
      deduplicated[#deduplicated + 1] = string.sub(fields[i], 14)
      deduplicated[#deduplicated + 1] = tonumber(fields[i + 1])
    end
  end
  reply[#reply + 1] = ready
  reply[#reply + 1] = delayed
  reply[#reply + 1] = math.max(0, rcall('HLEN', KEYS[base + 6]) - ready - delayed)
  reply[#reply + 1] = rcall('XLEN', KEYS[base + 5])
  reply[#reply + 1] = ready > 0 and oldest_ready_at(queue_key) or -1
  reply[#reply + 1] = #eta > 0 and tonumber(eta[2]) or -1
  reply[#reply + 1] = redelivered
  reply[#reply + 1] = dropped
  reply[#reply + 1] = paused
  reply[#reply + 1] = retrying
  reply[#reply + 1] = cap
  reply[#reply + 1] = rate
  reply[#reply + 1] = #fields > 0 and 1 or 0 -- an empty hash does not exist
  reply[#reply + 1] = deduplicated
end
return reply
