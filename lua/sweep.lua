#!lua flags=allow-oom
-- name: sweep
-- version: 14
-- summary: Periodic repair of queues: promote due delayed messages, restore timed-out deliveries, dead-letter what reached the delivery limit or expired, drop orphans.
-- KEYS: 8 per queue, repeated for each queue (all queues of one call must share a cluster slot)
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages, score = ETA in unix ms
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again; 'dedup:<sha1>' -> the end of a throttle window (publish): its hold goes
--   meta     HASH    P meta:{Q}            queue arguments ('retry_type', 'retry_min', 'retry_max': declare); 'expires' (ms) is refreshed on all eight keys; counters 'redelivered', 'retrying', 'dropped:<reason>' (HINCRBY); 'paused' (nothing promoted) and 'limits' are read; so is a fair queue's virtual clock 'fair' (publish), at which what is promoted or restored is ready
--   dead     STREAM  P dead:{Q}            dead letters: id, reason, delivery_count, priority, payload
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'; 'dedup:<sha1>' holds (publish)
--   wake     LIST    P wake:{Q}            the wake token: pushed when the sweep makes messages ready (not in a paused queue), or drops a delivery of a capped queue
-- ARGV:
--   1  visibility_ms       integer > 0       unused since version 6 (no ready message sits popped); still checked
--   2  delivery_limit      integer >= 0      delivery attempts before a message is dead-lettered; 0 means no limit
--   3  dead_letter_maxlen  integer >= 0      approximate cap of the dead-letter stream; 0 deletes dropped messages outright
--   4  batch               integer 1..10000  most entries looked at per queue and per kind in this call
--   5  report_limit        integer >= 0      most dropped messages returned with their payload
-- returns: array {promoted, requeued, unclaimed, backlog, limit_reached, expired, orphans, more, revoked,
--   then 5 items per reported dropped message: queue_position, id, delivery_count, reason, payload}
--   revoked: timed-out deliveries Celery's revoke() named (cancel marked them), dead-lettered
--   with reason 'revoked' instead of put back;
--   promoted: delayed messages made ready; requeued: timed-out deliveries put back (count + 1);
--   unclaimed: ready messages in neither the queue nor in flight, put back (not counted;
--   only scripts before version 6, which let BZMPOP pop messages, left such);
--   backlog: ready messages still queued whose index entry was moved to their TTL, or
--   dropped (not counted; only scripts before version 6 indexed every ready message);
--   limit_reached: deliveries that reached the delivery limit; expired: messages whose TTL
--   passed while they waited (both go to the dead-letter stream, or are deleted when
--   dead_letter_maxlen is 0); more: 1 when a batch was full, so the caller should sweep again.
-- errors:
--   ERR celery-redis-lua: sweep: expected 8 keys per queue, got N
--   ERR celery-redis-lua: sweep: expected 5 arguments, got N
--   ERR celery-redis-lua: sweep: key 'K' has no {hash tag}
--   ERR celery-redis-lua: sweep: NAME must be ... , got 'V'
-- why: an index entry that falls due means one of six things, told apart by the message's
--   state and the queue: its TTL passed (dead-letter it, reason 'expired'), it was
--   delivered and not acked in time (restore with delivery_count + 1, or dead-letter at
--   the limit), the message is gone (orphan: remove the entry), it still waits in the
--   delayed set (a keeper's extend, which moves any indexed id, raced the reject that made
--   the delivery a delayed retry: it keeps waiting, indexed again at its TTL; version 13
--   made it ready there too, so it ran at once and again at its ETA), or one of two
--   leftovers of scripts before version 6: a ready message still in the queue (backlog) or
--   one popped and never claimed (restore, not a delivery). A ready message is indexed only
--   at its TTL, a retry too, a countdown not until it is ready.
--   Whatever the sweep makes ready pushes the wake token; a queue left with nothing ready
--   or delayed drops it. A timed-out delivery of a queue whose x-delayed-retry-type is
--   'failed' or 'all' waits min(retry_min * delivery_count, retry_max or 10 years) ms (a stored
--   retry_min or retry_max past 10 years counts as 10 years, as in reject) in the delayed set
--   (state 'retry', counted in 'retrying') before it is ready again, as reject's requeue
--   does. A timed-out delivery frees a slot: one dropped (expired, delivery limit) in a
--   queue with an in-flight cap (the limit script) with messages ready pushes the token
--   too. A paused queue's due countdowns and retries are not promoted: they wait for resume,
--   as consume leaves them (its timed-out deliveries are still restored, to wait ready).
--   allow-oom, because the sweep mostly frees memory.

local rcall = redis.call

-- A token wakes a consumer for something that is there; with nothing ready or delayed it
-- would wake one in vain, and outlive the queue's messages: it goes.
local function drop_idle_wake(queue_key, delayed_key, wake_key)
  if redis.call('ZCARD', queue_key) == 0 and redis.call('ZCARD', delayed_key) == 0 then
    redis.call('DEL', wake_key)
  end
end

-- A consumer with nothing to do blocks on the wake list (BLPOP); a token there wakes one,
-- which runs consume. Pushed only into an empty list: one LLEN while a token already waits.
local function arm_wake(wake_key)
  if redis.call('LLEN', wake_key) > 0 then return false end
  redis.call('RPUSH', wake_key, '1')
  return true
end

-- A slot freed in a queue with an in-flight cap (the limit script: meta's 'limits' is
-- 'IN_FLIGHT RATE', '-' for unset) wakes a consumer the cap held back (consume dropped the
-- token when it stopped at the cap), when something is ready or delayed (it learns the
-- ETA) and the queue is not paused. A queue without a cap pays one HGET of one field.
-- Returns whether it pushed the token.
local function wake_freed_slot(meta_key, queue_key, delayed_key, wake_key)
  local limits = redis.call('HGET', meta_key, 'limits')
  if not limits or not string.match(limits, '^%d') then return false end
  return redis.call('ZCARD', queue_key) + redis.call('ZCARD', delayed_key) > 0
    and redis.call('HEXISTS', meta_key, 'paused') == 0 and arm_wake(wake_key)
end

-- The task-id index (publish writes it, where/cancel read it): 'task:<task id>' -> message
-- id, a field of the state hash; the task id is also the last word of the message's state
-- string (parse_state's `task`). A message that goes takes its entry with it; a newer
-- message of the same task id (a retry) keeps its own. 'revoked:<task id>' (cancel, for a
-- delivery Celery's revoke() named) goes in the same call. So does the hold on a dedup id
-- (publish's simple and debounce modes: 'dedup:<sha1 of the id>' -> 'HOLDER UNTIL MODE ID',
-- the sha1 also in the message's state string), when it is still this message's.
local function forget_task(state_key, id, s)
  if not s then return end
  if s.task ~= '' and redis.call('HGET', state_key, 'task:' .. s.task) == id then
    redis.call('HDEL', state_key, 'task:' .. s.task, 'revoked:' .. s.task)
  end
  if s.dedup ~= '' then
    local hold = redis.call('HGET', state_key, 'dedup:' .. s.dedup)
    if hold and string.sub(hold, 1, #id + 1) == id .. ' ' then
      redis.call('HDEL', state_key, 'dedup:' .. s.dedup)
    end
  end
end
local PRIORITY_FACTOR = 10000000000000 -- 10^13 ms per priority level (317 years)
local QUEUE_KEYS = 8

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: sweep: ' .. message)
end

local function natural(value)
  if not string.match(value, '^%d+$') then return nil end
  return tonumber(value)
end

-- Counters for dashboards (metrics.lua reads them): redeliveries and drops by reason, in the
-- queue's meta hash, so they expire and go with the queue. Written before its expiry refresh.
local function count_in_meta(meta_key, field, n)
  if n > 0 then redis.call('HINCRBY', meta_key, field, n) end
end

-- 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'; a malformed value reads as a
-- fresh ready message. DEDUP: the sha1 (hex) of the dedup id this message holds until it goes
-- (publish's simple and debounce modes), '' when none. The task id goes last because it may
-- hold spaces; '' when there is none.
local function parse_state(value)
  local state, count, priority, expires_at, dedup, task =
    string.match(value, '^(%a+) (%d+) (%d+) ([^%s:]+):?(%x*) ?(.*)$')
  if not state then return {state = 'ready', count = 0, priority = 0, expires_at = '-', dedup = '', task = ''} end
  return {state = state, count = tonumber(count), priority = tonumber(priority), expires_at = expires_at,
          dedup = dedup, task = task}
end

-- The state string parse_state reads back, for message `s` in `state` after `count` deliveries.
local function state_line(state, count, s)
  local line = state .. string.format(' %d %d ', count, s.priority) .. s.expires_at -- '%d': no float printing
  if (s.dedup or '') ~= '' then line = line .. ':' .. s.dedup end
  if s.task == '' then return line end
  return line .. ' ' .. s.task
end

local MAX_DURATION_MS = 315360000000 -- 10 years in ms, the longest duration taken or read back (bounds.py)

-- A duration stored in meta (ms), as the scripts apply it: one past MAX_DURATION_MS (an
-- older version took any integer, or a hand set it) counts as MAX_DURATION_MS, longer than
-- anything waits, instead of overflowing the sums with the clock; not a positive integer:
-- nil, not set.
local function stored_ms(value)
  local n = value and string.match(value, '^%d+$') and tonumber(value)
  if not n or n < 1 then return nil end
  return math.min(n, MAX_DURATION_MS)
end

-- Delayed retry (RabbitMQ 4.3's x-delayed-retry-*, stored by declare): whether a requeue of
-- kind `cause` ('failed' or 'returned') waits before it is ready again (nil: it does not),
-- and for how long: min(retry_min * delivery_count, retry_max or MAX_DURATION_MS) ms, so a
-- due time never passes now + 10 years, whatever was stored or however many deliveries.
-- Read with it: a fair queue's virtual clock, at which what is made ready again is scored.
local function retry_policy(meta_key, cause)
  local r = redis.call('HMGET', meta_key, 'retry_type', 'retry_min', 'retry_max', 'fair')
  local min, clock = stored_ms(r[2]), tonumber(r[4]) -- clock: a fair queue's V (publish), nil if not fair
  if not min or (r[1] ~= 'all' and r[1] ~= cause) then return nil, clock end
  return {min = min, max = stored_ms(r[3])}, clock
end

local function retry_delay(policy, count)
  return math.min(policy.min * count, policy.max or MAX_DURATION_MS)
end

if #KEYS == 0 or #KEYS % QUEUE_KEYS ~= 0 then return fail('expected 8 keys per queue, got ' .. #KEYS) end
if #ARGV ~= 5 then return fail('expected 5 arguments, got ' .. #ARGV) end
local visibility = natural(ARGV[1])
if not visibility or visibility == 0 then
  return fail("visibility_ms must be a positive integer, got '" .. ARGV[1] .. "'")
end
local limit = natural(ARGV[2])
if not limit then return fail("delivery_limit must be an integer >= 0, got '" .. ARGV[2] .. "'") end
local dead_maxlen = natural(ARGV[3])
if not dead_maxlen then return fail("dead_letter_maxlen must be an integer >= 0, got '" .. ARGV[3] .. "'") end
local batch = natural(ARGV[4])
if not batch or batch < 1 or batch > 10000 then
  return fail("batch must be an integer in 1..10000, got '" .. ARGV[4] .. "'")
end
local report_limit = natural(ARGV[5])
if not report_limit then return fail("report_limit must be an integer >= 0, got '" .. ARGV[5] .. "'") end

-- Validate every queue key before the first write, so bad input changes nothing.
for q = 1, #KEYS / QUEUE_KEYS do
  local queue_key = KEYS[QUEUE_KEYS * (q - 1) + 1]
  local open = string.find(queue_key, '{', 1, true)
  local close = open and string.find(queue_key, '}', open + 1, true)
  if not close or close == open + 1 then return fail("key '" .. queue_key .. "' has no {hash tag}") end
end

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local function ready_score(priority, ready_at)
  return string.format('%d', (255 - priority) * PRIORITY_FACTOR + ready_at)
end

-- Of the index entries due, the message ids; the others are throttle windows (publish's dedup,
-- 'dedup:<sha1>' at the window's end), which end here: the hold goes, unless a later publish
-- made it another (a simple or debounce hold, or a later window, indexed at its own end).
local function end_windows(index_key, state_key, entries)
  local ids = {}
  for _, entry in ipairs(entries) do
    if string.sub(entry, 1, 6) == 'dedup:' then
      local held = rcall('HGET', state_key, entry)
      local until_ms, kind
      if held then until_ms, kind = string.match(held, '^%S+ (%S+) (%a+)') end
      if kind == 'throttle' and (tonumber(until_ms) or 0) <= now then rcall('HDEL', state_key, entry) end
      rcall('ZREM', index_key, entry)
    else
      ids[#ids + 1] = entry
    end
  end
  return ids
end

-- A ready message is indexed only to be dropped at its TTL; one without a TTL has no entry.
local function index_ready(index_key, id, s)
  if tonumber(s.expires_at) then
    rcall('ZADD', index_key, s.expires_at, id)
  else
    rcall('ZREM', index_key, id)
  end
end

local promoted, requeued, unclaimed, backlog, limit_reached, expired, orphans, more = 0, 0, 0, 0, 0, 0, 0, 0
local revoked = 0
local reported = {}

for q = 1, #KEYS / QUEUE_KEYS do
  local base = QUEUE_KEYS * (q - 1)
  local queue_key, delayed_key, index_key, meta_key = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]
  local dead_key, message_key, state_key, wake_key = KEYS[base + 5], KEYS[base + 6], KEYS[base + 7], KEYS[base + 8]
  local requeued_before, expired_before, limit_before, revoked_before = requeued, expired, limit_reached, revoked
  local retrying = 0 -- the change of the queue's 'retrying' counter
  local ready_before = promoted + requeued + unclaimed
  local freed = false -- a delivery dropped: its slot of an in-flight cap is free

  local function drop(id, s, payload, reason, count)
    if dead_maxlen > 0 then
      rcall('XADD', dead_key, 'MAXLEN', '~', dead_maxlen, '*', 'id', id, 'reason', reason,
            'delivery_count', count, 'priority', s.priority, 'payload', payload)
    end
    rcall('HDEL', message_key, id)
    forget_task(state_key, id, s)
    rcall('HDEL', state_key, id)
    rcall('ZREM', queue_key, id)
    rcall('ZREM', index_key, id)
    if s.state == 'retry' or s.state == 'delayed' then rcall('ZREM', delayed_key, id) end
    if s.state == 'retry' then retrying = retrying - 1 end
    if s.state == 'unacked' then freed = true end
    if #reported < 5 * report_limit then
      for _, item in ipairs({q, id, count, reason, payload}) do reported[#reported + 1] = item end
    end
  end

  local due = rcall('ZRANGE', delayed_key, '-inf', now, 'BYSCORE', 'LIMIT', 0, batch, 'WITHSCORES')
  local clock -- a fair queue's virtual clock (publish): what becomes ready here is scored at it
  if #due > 0 then
    local m = rcall('HMGET', meta_key, 'paused', 'fair')
    if m[1] then due = {} end -- they wait for resume
    clock = tonumber(m[2])
  end
  for i = 1, #due, 2 do
    local id, eta = due[i], tonumber(due[i + 1])
    local raw = rcall('HGET', state_key, id)
    if raw then
      local s = parse_state(raw)
      rcall('ZADD', queue_key, ready_score(s.priority, clock or eta), id)
      if tonumber(s.expires_at) then rcall('ZADD', index_key, s.expires_at, id) end
      rcall('HSET', state_key, id, state_line('ready', s.count, s))
      if s.state == 'retry' then retrying = retrying - 1 end
      promoted = promoted + 1
    else
      rcall('HDEL', message_key, id)
      orphans = orphans + 1
    end
    rcall('ZREM', delayed_key, id)
  end
  if #due == 2 * batch then more = 1 end

  local entries = rcall('ZRANGE', index_key, '-inf', now, 'BYSCORE', 'LIMIT', 0, batch)
  if #entries == batch then more = 1 end
  entries = end_windows(index_key, state_key, entries)
  local retry = false -- a timeout is a failed delivery
  if #entries > 0 then retry, clock = retry_policy(meta_key, 'failed') end
  for _, id in ipairs(entries) do
    local payload = rcall('HGET', message_key, id)
    local raw = rcall('HGET', state_key, id)
    local queued_score = rcall('ZSCORE', queue_key, id)
    local s = raw and parse_state(raw)
    local ttl_at = s and tonumber(s.expires_at)
    if not payload or not s then
      rcall('ZREM', index_key, id)
      rcall('ZREM', queue_key, id)
      rcall('HDEL', message_key, id)
      forget_task(state_key, id, s)
      rcall('HDEL', state_key, id)
      orphans = orphans + 1
    elseif s.state ~= 'unacked' and ttl_at and ttl_at <= now then
      drop(id, s, payload, 'expired', s.count)
      expired = expired + 1
    elseif queued_score then
      index_ready(index_key, id, s)
      backlog = backlog + 1
    elseif (s.state == 'retry' or s.state == 'delayed') and rcall('ZSCORE', delayed_key, id) then
      -- Still waiting for its ETA: it waits on, a retry indexed at its TTL, a countdown not at all.
      if s.state == 'retry' then index_ready(index_key, id, s) else rcall('ZREM', index_key, id) end
    elseif s.state ~= 'unacked' then
      rcall('ZADD', queue_key, ready_score(s.priority, clock or now), id)
      rcall('ZREM', delayed_key, id) -- ready only (a state set by hand may say 'ready' there)
      index_ready(index_key, id, s)
      rcall('HSET', state_key, id, state_line('ready', s.count, s))
      if s.state == 'retry' then retrying = retrying - 1 end
      unclaimed = unclaimed + 1
    else
      local attempts = s.count + 1
      if s.task ~= '' and rcall('HEXISTS', state_key, 'revoked:' .. s.task) == 1 then
        drop(id, s, payload, 'revoked', s.count) -- revoked while in flight: never run again
        revoked = revoked + 1
      elseif ttl_at and ttl_at <= now then
        drop(id, s, payload, 'expired', attempts) -- timed out, and its TTL passed meanwhile
        expired = expired + 1
      elseif retry and (limit == 0 or attempts < limit) then
        rcall('HSET', state_key, id, state_line('retry', attempts, s))
        rcall('ZADD', delayed_key, string.format('%d', now + retry_delay(retry, attempts)), id)
        index_ready(index_key, id, s) -- waiting, it is indexed only at its TTL, as when ready
        requeued, retrying = requeued + 1, retrying + 1
      elseif limit == 0 or attempts < limit then
        rcall('HSET', state_key, id, state_line('ready', attempts, s))
        rcall('ZADD', queue_key, ready_score(s.priority, clock or now), id)
        index_ready(index_key, id, s)
        requeued = requeued + 1
      else
        drop(id, s, payload, 'delivery-limit', attempts)
        limit_reached = limit_reached + 1
      end
    end
  end

  if promoted + requeued + unclaimed > ready_before then
    if rcall('HEXISTS', meta_key, 'paused') == 0 then arm_wake(wake_key) end -- a paused queue wakes nobody
  else
    if freed then wake_freed_slot(meta_key, queue_key, delayed_key, wake_key) end
    drop_idle_wake(queue_key, delayed_key, wake_key) -- e.g. the last ones expired
  end
  count_in_meta(meta_key, 'redelivered', requeued - requeued_before)
  if retrying ~= 0 then rcall('HINCRBY', meta_key, 'retrying', retrying) end
  count_in_meta(meta_key, 'dropped:expired', expired - expired_before)
  count_in_meta(meta_key, 'dropped:delivery-limit', limit_reached - limit_before)
  count_in_meta(meta_key, 'dropped:revoked', revoked - revoked_before)
  local expires = stored_ms(rcall('HGET', meta_key, 'expires'))
  if expires then
    local at = string.format('%d', now + expires) -- one absolute time: the keys expire together
    for i = 1, QUEUE_KEYS do rcall('PEXPIREAT', KEYS[base + i], at) end
  end
end

local reply = {promoted, requeued, unclaimed, backlog, limit_reached, expired, orphans, more, revoked}
for _, item in ipairs(reported) do reply[#reply + 1] = item end
return reply
