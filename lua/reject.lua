#!lua flags=allow-oom
-- name: reject
-- version: 15
-- summary: Reject delivered messages of one queue: requeue them (counted against the delivery limit, after the queue's retry delay) or drop them.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages, score = ETA in unix ms; a delayed retry waits here
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments ('retry_type', 'retry_min', 'retry_max': declare); 'expires' (ms) is refreshed on all eight keys; counters 'redelivered', 'retrying', 'dropped:<reason>' (HINCRBY); 'limits' (and 'paused' when it holds a cap) are read; so is a fair queue's virtual clock 'fair' (publish), at which a requeued message is ready again
--   dead     STREAM  P dead:{Q}            dead letters: id, reason, delivery_count, priority, payload
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'
--   wake     LIST    P wake:{Q}            the wake token: pushed when a requeue makes a message ready (not in a paused queue), or a drop frees a slot of a capped queue; dropped when a waiting message dropped leaves nothing ready or delayed
-- ARGV:
--   1   requeue             failed, returned or drop (1 and 0 are failed and drop)   failed: a consumer rejected it with requeue; returned: handed back unstarted; both are counted redeliveries; drop: dead-letter it
--   2   delivery_limit      integer >= 0     delivery attempts before a message is dead-lettered; 0 means no limit
--   3   dead_letter_maxlen  integer >= 0     approximate cap of the dead-letter stream; 0 deletes dropped messages outright
--   4   visibility_ms       integer > 0      unused since version 7 (no ready message sits popped); still checked
--   5.. id                  string           message ids to reject, each optionally as id:delivery_count
-- returns: array {requeued, dead_lettered, deleted, stale} counts (a requeue of a delivery Celery's
--   revoke() named, marked by cancel, is dead-lettered with reason 'revoked' instead)
-- errors:
--   ERR celery-redis-lua: reject: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: reject: expected at least 5 arguments, got N
--   ERR celery-redis-lua: reject: requeue must be failed, returned, drop, 1 or 0, got 'V'
--   ERR celery-redis-lua: reject: delivery_limit must be an integer >= 0, got 'V'
--   ERR celery-redis-lua: reject: dead_letter_maxlen must be an integer >= 0, got 'V'
--   ERR celery-redis-lua: reject: visibility_ms must be a positive integer, got 'V'
--   ERR celery-redis-lua: reject: id 'V' must be an id or id:delivery_count
-- why: delivery counting follows RabbitMQ quorum queues: the first delivery has count 0,
--   every requeue adds one, and a message whose next attempt would be number
--   delivery_limit + 1 is dead-lettered instead (reason 'delivery-limit'). A message
--   rejected without requeue is dead-lettered with reason 'rejected' so an operator can
--   see and replay it. allow-oom, because rejecting must work on a full server.
--   id:delivery_count rejects only that delivery: a message whose count has moved on
--   (the sweep restored it and another consumer holds it now) is left alone and
--   counted stale, so a late hand-back cannot requeue or drop someone else's delivery.
--   A requeued message keeps its TTL deadline (as in RabbitMQ); if it has passed, the
--   next consume or sweep dead-letters it with reason 'expired'. A requeue pushes the
--   wake token, so a consumer blocked with nothing to do takes the message at once. A queue
--   declared with x-delayed-retry-type (RabbitMQ 4.3's names) delays a requeue of that kind
--   ('all' both) by min(retry_min * delivery_count, retry_max or 10 years) ms (a stored
--   retry_min or retry_max past 10 years, left by an older version or by hand, counts as 10
--   years, so the due time never overflows): the message waits in the
--   delayed set in state 'retry', priority and count kept, and is counted in 'retrying'
--   until consume or the sweep makes it ready. The token is pushed then too, so a blocked
--   consumer learns the earlier ETA. A dropped delivery frees a slot: in a queue with an
--   in-flight cap (the limit script) with messages ready, it pushes the token too.
--   A message rejected by id alone while it waits in the delayed set (a countdown, or a
--   delayed retry) waits no more: it leaves that set, ready at once or dead-lettered, or
--   waits for a retry of its own (version 14 left a requeued countdown in the delayed set
--   too, so it was delivered again at its ETA); one dropped takes an idle token with it.

local rcall = redis.call

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

-- A token wakes a consumer for something that is there; with nothing ready or delayed it
-- would wake one in vain, and outlive the queue's messages: it goes.
local function drop_idle_wake(queue_key, delayed_key, wake_key)
  if redis.call('ZCARD', queue_key) == 0 and redis.call('ZCARD', delayed_key) == 0 then
    redis.call('DEL', wake_key)
  end
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

-- ARGV[first..] as 'id' or 'id:delivery_count' (the count fences the call to that one
-- delivery): the ids and their counts (nil: not fenced), or nil and the first bad one.
local function fenced_ids(first)
  local ids, counts, n = {}, {}, 0
  for i = first, #ARGV do
    local arg = ARGV[i]
    local colon = string.find(arg, ':', 1, true) -- a plain find: most ids come without a count
    local id, count = arg, nil
    if colon then
      id, count = string.sub(arg, 1, colon - 1), string.match(arg, '^%d+$', colon + 1)
      if id == '' or not count then return nil, arg end
      count = tonumber(count)
    elseif arg == '' then
      return nil, arg
    end
    n = n + 1
    ids[n], counts[n] = id, count
  end
  return ids, counts
end

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: reject: ' .. message)
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

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
if #ARGV < 5 then return fail('expected at least 5 arguments, got ' .. #ARGV) end
local queue_key, delayed_key, index_key, meta_key, dead_key, message_key, state_key = unpack(KEYS, 1, 7)
local wake_key = KEYS[8]
local CAUSES = {['1'] = 'failed', failed = 'failed', returned = 'returned', ['0'] = false, drop = false}
local cause = CAUSES[ARGV[1]]
if cause == nil then return fail("requeue must be failed, returned, drop, 1 or 0, got '" .. ARGV[1] .. "'") end
local requeue = cause ~= false
local limit = natural(ARGV[2])
if not limit then return fail("delivery_limit must be an integer >= 0, got '" .. ARGV[2] .. "'") end
local dead_maxlen = natural(ARGV[3])
if not dead_maxlen then return fail("dead_letter_maxlen must be an integer >= 0, got '" .. ARGV[3] .. "'") end
local visibility = natural(ARGV[4])
if not visibility or visibility == 0 then
  return fail("visibility_ms must be a positive integer, got '" .. ARGV[4] .. "'")
end

-- Validate every id before changing anything: a bad one must not leave a half-done batch.
local ids, expected = fenced_ids(5)
if not ids then return fail("id '" .. expected .. "' must be an id or id:delivery_count") end

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local retry, clock = false, nil -- clock: a fair queue's V, the time part of a requeued message's score
if requeue then retry, clock = retry_policy(meta_key, cause) end
local requeued, dead_lettered, deleted, stale, retrying, unwaited = 0, 0, 0, 0, 0, 0
local dropped = {} -- reason -> dead-lettered or deleted
for i, id in ipairs(ids) do
  local payload = rcall('HGET', message_key, id)
  local raw = rcall('HGET', state_key, id)
  local s = raw and parse_state(raw)
  if payload and s and expected[i] and expected[i] ~= s.count then
    stale = stale + 1 -- delivered again since: not this consumer's to reject
  elseif payload and s then
    local attempts = s.count + 1
    -- A delivery Celery's revoke() named (cancel marked it) that comes back is dead-lettered.
    local revoked = requeue and s.task ~= '' and rcall('HEXISTS', state_key, 'revoked:' .. s.task) == 1
    if (s.state == 'retry' or s.state == 'delayed') and not (retry and (limit == 0 or attempts < limit)) then
      rcall('ZREM', delayed_key, id) -- rejected by id alone while it waited: it waits no more
      if s.state == 'retry' then retrying = retrying - 1 end
      unwaited = unwaited + 1
    end
    if retry and not revoked and (limit == 0 or attempts < limit) then
      rcall('HSET', state_key, id, state_line('retry', attempts, s))
      rcall('ZADD', delayed_key, string.format('%d', now + retry_delay(retry, attempts)), id)
      if tonumber(s.expires_at) then rcall('ZADD', index_key, s.expires_at, id) else rcall('ZREM', index_key, id) end
      rcall('ZREM', queue_key, id) -- a ready one (rejected by id alone) is no longer ready
      if s.state ~= 'retry' then retrying = retrying + 1 end
      requeued = requeued + 1
    elseif requeue and not revoked and (limit == 0 or attempts < limit) then
      rcall('HSET', state_key, id, state_line('ready', attempts, s))
      rcall('ZADD', queue_key, string.format('%d', (255 - s.priority) * PRIORITY_FACTOR + (clock or now)), id)
      if tonumber(s.expires_at) then -- ready: indexed only to be dropped at its TTL
        rcall('ZADD', index_key, s.expires_at, id)
      else
        rcall('ZREM', index_key, id)
      end
      requeued = requeued + 1
    else
      local reason = revoked and 'revoked' or requeue and 'delivery-limit' or 'rejected'
      if dead_maxlen > 0 then
        rcall('XADD', dead_key, 'MAXLEN', '~', dead_maxlen, '*', 'id', id, 'reason', reason,
              'delivery_count', reason == 'delivery-limit' and attempts or s.count,
              'priority', s.priority, 'payload', payload)
        dead_lettered = dead_lettered + 1
      else
        deleted = deleted + 1
      end
      dropped[reason] = (dropped[reason] or 0) + 1
      rcall('HDEL', message_key, id)
      forget_task(state_key, id, s)
      rcall('HDEL', state_key, id)
      rcall('ZREM', queue_key, id)
      rcall('ZREM', index_key, id)
    end
  else
    rcall('ZREM', index_key, id) -- already gone (acked elsewhere, expired, or its queue deleted)
    rcall('HDEL', message_key, id)
    forget_task(state_key, id, s)
    rcall('HDEL', state_key, id)
  end
end

if requeued > 0 then
  if rcall('HEXISTS', meta_key, 'paused') == 0 then arm_wake(wake_key) end -- a paused queue wakes nobody
elseif dead_lettered + deleted > 0 then
  -- A waiting message dropped may leave its token idle (a countdown's publish pushed one).
  if unwaited > 0 then drop_idle_wake(queue_key, delayed_key, wake_key) end
  wake_freed_slot(meta_key, queue_key, delayed_key, wake_key)
end
count_in_meta(meta_key, 'redelivered', requeued)
if retrying ~= 0 then rcall('HINCRBY', meta_key, 'retrying', retrying) end
for reason, n in pairs(dropped) do count_in_meta(meta_key, 'dropped:' .. reason, n) end
local expires = stored_ms(rcall('HGET', meta_key, 'expires'))
if expires then
  local at = string.format('%d', now + expires) -- one absolute time: the keys expire together
  for i = 1, 8 do rcall('PEXPIREAT', KEYS[i], at) end
end
return {requeued, dead_lettered, deleted, stale}
