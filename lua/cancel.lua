#!lua flags=allow-oom
-- name: cancel
-- version: 8
-- summary: Take a task's ready, delayed or retry-waiting message out of its queue so it never runs, as a dead letter with reason 'cancelled' (or 'revoked').
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages, score = ETA in unix ms
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments; counters 'dropped:cancelled' or 'dropped:revoked', 'retrying' (HINCRBY)
--   dead     STREAM  P dead:{Q}            dead letters: id, reason, delivery_count, priority, payload
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'; 'task:<task id>' -> id
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (dropped once nothing is queued)
-- ARGV:
--   1  task_id             string, non-empty, at most 256 bytes   the Celery task id the producer passed to publish
--   2  dead_letter_maxlen  integer >= 0                           approximate cap of the dead-letter stream; 0 deletes the message outright
--   3  reason              'cancelled' | 'revoked', optional       the dead letter's reason: 'revoked' when Celery's revoke() asked (the transport sees it pass), 'cancelled' (default) for the CLI's cancel
-- returns: array {outcome, id, state}: outcome 'cancelled' (state: 'ready', 'delayed' or 'retry', the
--   message is gone and dead-lettered), 'in_flight' (a consumer holds it: left to it; with reason
--   'revoked' it is marked, 'revoked:<task id>' in state, so that reject and sweep dead-letter it
--   if it comes back), or {'missing'} (no message of that task id in this queue)
-- errors:
--   ERR celery-redis-lua: cancel: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: cancel: expected 2 or 3 arguments, got N
--   ERR celery-redis-lua: cancel: task_id must be a non-empty string of at most 256 bytes
--   ERR celery-redis-lua: cancel: dead_letter_maxlen must be an integer >= 0, got 'V'
--   ERR celery-redis-lua: cancel: reason must be 'cancelled' or 'revoked', got 'V'
-- why: atomic, so a message is either cancelled or delivered, never both: a consumer that
--   takes it first makes it in flight, and cancel leaves a delivery alone (the delivery
--   count would otherwise be lost, and Celery's revoke covers a running task). A
--   countdown waits in the broker (Celery workers forget revokes after 3 hours and on
--   restart), so this is how a revoked countdown is kept from running. The dead letter can
--   be replayed (dead_replay). allow-oom: it frees memory.
--   A stored 'expires' past 10 years (an older version's, or set by hand) counts as 10
--   years (stored_ms), so the expiry refresh never overflows string.format('%d').

local rcall = redis.call
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

-- A token wakes a consumer for something that is there; with nothing ready or delayed it
-- would wake one in vain, and outlive the queue's messages: it goes.
local function drop_idle_wake(queue_key, delayed_key, wake_key)
  if redis.call('ZCARD', queue_key) == 0 and redis.call('ZCARD', delayed_key) == 0 then
    redis.call('DEL', wake_key)
  end
end

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: cancel: ' .. message)
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

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
if #ARGV ~= 2 and #ARGV ~= 3 then return fail('expected 2 or 3 arguments, got ' .. #ARGV) end
local task_id = ARGV[1]
if task_id == '' or #task_id > 256 then return fail('task_id must be a non-empty string of at most 256 bytes') end
if not string.match(ARGV[2], '^%d+$') then
  return fail("dead_letter_maxlen must be an integer >= 0, got '" .. ARGV[2] .. "'")
end
local dead_maxlen = tonumber(ARGV[2])
local reason = ARGV[3] or 'cancelled'
if reason ~= 'cancelled' and reason ~= 'revoked' then
  return fail("reason must be 'cancelled' or 'revoked', got '" .. reason .. "'")
end
local queue_key, delayed_key, index_key, meta_key, dead_key, message_key, state_key = unpack(KEYS)

local id = rcall('HGET', state_key, 'task:' .. task_id)
local raw = id and rcall('HGET', state_key, id)
if not raw then return {'missing'} end
local s = parse_state(raw)
if s.state == 'unacked' then
  -- Celery's revoke() names it: should it come back (its worker died, its lease lapsed, it
  -- was handed back) reject and sweep dead-letter it, reason 'revoked'; ack and every
  -- script that drops it take the mark with the task index (forget_task).
  if reason == 'revoked' then rcall('HSET', state_key, 'revoked:' .. task_id, 1) end
  return {'in_flight', id, s.state}
end

local payload = rcall('HGET', message_key, id)
if payload and dead_maxlen > 0 then
  rcall('XADD', dead_key, 'MAXLEN', '~', dead_maxlen, '*', 'id', id, 'reason', reason,
        'delivery_count', s.count, 'priority', s.priority, 'payload', payload)
end
rcall('ZREM', queue_key, id)
rcall('ZREM', delayed_key, id)
rcall('ZREM', index_key, id)
rcall('HDEL', message_key, id)
forget_task(state_key, id, s)
rcall('HDEL', state_key, id)
drop_idle_wake(queue_key, delayed_key, KEYS[8])
count_in_meta(meta_key, 'dropped:' .. reason, 1)
if s.state == 'retry' then rcall('HINCRBY', meta_key, 'retrying', -1) end -- it waited to retry

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expires = stored_ms(rcall('HGET', meta_key, 'expires'))
if expires then
  local at = string.format('%d', now + expires) -- one absolute time: the keys expire together
  for i = 1, 8 do rcall('PEXPIREAT', KEYS[i], at) end
end
return {'cancelled', id, s.state}
