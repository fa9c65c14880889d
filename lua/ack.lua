#!lua flags=allow-oom
-- name: ack
-- version: 12
-- summary: Acknowledge messages of one queue: delete them and every trace of them, fenced by the delivery's count.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages (a restored copy of an acked message is removed too)
--   delayed  ZSET    P delayed:{Q}         delayed messages (a copy waiting for a delayed retry is removed too)
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments (not touched); 'limits' (and 'paused' when it holds a cap) are read; 'retrying' less the retries cancelled (HINCRBY)
--   dead     STREAM  P dead:{Q}            dead letters (not touched)
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'; the message's task-id index entry goes too
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (dropped when an ack leaves nothing queued; pushed when it frees a slot of a capped queue, expiring with meta)
-- ARGV:
--   1.. id  string   message ids to acknowledge, each optionally as id:delivery_count
-- returns: array {acked, then the id of each stale ack}: acked counts the messages that still
--   existed and were deleted; a stale ack (id:delivery_count of a message another consumer
--   now holds, delivered with another count) is left alone and its id returned
-- errors:
--   ERR celery-redis-lua: ack: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: ack: expected at least one id
--   ERR celery-redis-lua: ack: id 'V' must be an id or id:delivery_count
-- why: allow-oom, because acking frees memory and must work on a full server. Acking a
--   message that the sweep already put back (visibility timeout passed), ready or waiting
--   for a delayed retry, cancels that copy, so a slow but successful task does not run
--   again. id:delivery_count fences the ack as reject is fenced: a message in flight with
--   another count was delivered again since, to a consumer that holds it now; deleting it
--   would take that consumer's delivery (and its slot of an in-flight cap), so it is left
--   alone and reported. Acking twice is harmless: ids are never reused, so a late or
--   repeated ack cannot touch another message. Every queue script takes the same eight
--   keys, so a caller builds them in one place. An ack frees a slot: in a queue with an
--   in-flight cap (the limit script) with messages ready, it pushes the wake token, so a
--   consumer the cap held back takes the slot at once.
--   A batch of ids costs the same calls as one: the task index entries are read in one
--   HMGET and go in the HDEL of the states.

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
-- delivery Celery's revoke() named) goes with it. So does the hold on a dedup id (publish's
-- simple and debounce modes: 'dedup:<sha1 of the id>' -> 'HOLDER UNTIL MODE ID', the sha1
-- also in the message's state string), when it is still this message's. The other scripts'
-- forget_task deletes them in an HDEL of their own; an ack deletes them with the state, in
-- one HDEL: for one message (a lone ack) here, with no table made (s: its parsed state).
local function forget_one(state_key, id, s)
  local task = s and s.task ~= '' and 'task:' .. s.task
  if task and redis.call('HGET', state_key, task) ~= id then task = false end
  local hold = s and s.dedup ~= '' and 'dedup:' .. s.dedup
  if hold then
    local value = redis.call('HGET', state_key, hold)
    if not (value and string.sub(value, 1, #id + 1) == id .. ' ') then hold = false end
  end
  if task and hold then return redis.call('HDEL', state_key, id, task, 'revoked:' .. s.task, hold) end
  if task then return redis.call('HDEL', state_key, id, task, 'revoked:' .. s.task) end
  if hold then return redis.call('HDEL', state_key, id, hold) end
  return redis.call('HDEL', state_key, id)
end

-- forget_one's rule for many messages at once: the entries of messages `ids` (parsed states
-- `states`, nil for none) read in one HMGET, and the fields to delete appended to `fields`,
-- so that they go in the HDEL that deletes the messages' states (no call per message).
-- `fields` may be `ids` itself: every id is read before anything is appended.
local function forgotten_fields(state_key, ids, states, fields)
  local count, probes, n = #ids, {}, 0 -- count: before anything is appended
  for i = 1, count do
    local s = states[i]
    if s and s.task ~= '' then n = n + 1 probes[n] = 'task:' .. s.task end
    if s and s.dedup ~= '' then n = n + 1 probes[n] = 'dedup:' .. s.dedup end
  end
  if n == 0 then return fields end
  local values
  if n <= 4000 then
    values = redis.call('HMGET', state_key, unpack(probes))
  else -- in chunks that Lua's unpack() can take
    values = {}
    for first = 1, n, 4000 do
      local some = redis.call('HMGET', state_key, unpack(probes, first, math.min(first + 3999, n)))
      for j = 1, #some do values[first + j - 1] = some[j] end
    end
  end
  local k = 0 -- the probes again, in the order they were made
  for i = 1, count do
    local s, id = states[i], ids[i]
    if s and s.task ~= '' then
      k = k + 1
      if values[k] == id then fields[#fields + 1] = probes[k] fields[#fields + 1] = 'revoked:' .. s.task end
    end
    if s and s.dedup ~= '' then
      k = k + 1
      if values[k] and string.sub(values[k], 1, #id + 1) == id .. ' ' then fields[#fields + 1] = probes[k] end
    end
  end
  return fields
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

-- A wake list made here expires with the queue (x-expires): at meta's expiry time, which
-- all of the queue's keys share; not refreshed, as an operator's change is no consumer's
-- activity.
local function expire_with_meta(meta_key, key)
  local at = redis.call('PEXPIRETIME', meta_key)
  if at > 0 then redis.call('PEXPIREAT', key, at) end
end

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: ack: ' .. message)
end

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
if #ARGV < 1 then return fail('expected at least one id') end

-- Validate every id before changing anything: a bad one must not leave a half-done batch.
local ids, expected = fenced_ids(1)
if not ids then return fail("id '" .. expected .. "' must be an id or id:delivery_count") end

-- One command over many arguments, in chunks that Lua's unpack() can take.
local function variadic(command, key, items)
  local total = 0
  for first = 1, #items, 4000 do
    total = total + rcall(command, key, unpack(items, first, math.min(first + 3999, #items)))
  end
  return total
end

-- Each state tells whether the ack is stale, where a copy waits, and its task id. What is
-- not stale is acked: the ids themselves, unless some are (the common path copies nothing).
-- A message in flight is in no set but the index, so the common ack removes it from no
-- other; one waiting (a countdown, a delayed retry) is in the delayed set; anything else
-- (a ready copy the sweep put back, or a state gone, unreadable or of a word this version
-- does not know) is taken out of the ready set, so that none is left in it.
local stale, waiting, retries, parsed, ready = {}, {}, 0, {}, nil
for first = 1, #ids, 4000 do
  local states = rcall('HMGET', KEYS[7], unpack(ids, first, math.min(first + 3999, #ids)))
  for i, raw in ipairs(states) do
    local n = first + i - 1
    local s = raw and parse_state(raw)
    if s and expected[n] and s.state == 'unacked' and s.count ~= expected[n] then
      stale[#stale + 1] = n -- delivered again since: that consumer's now
    else
      parsed[n] = s -- acked: its task index entry and dedup hold go with it
      if s and (s.state == 'retry' or s.state == 'delayed') then
        waiting[#waiting + 1] = ids[n]
        if s.state == 'retry' then retries = retries + 1 end
      elseif not (s and s.state == 'unacked') then
        ready = ready or {}
        ready[#ready + 1] = ids[n]
      end
    end
  end
end
local reply, acked = {0}, ids
if #stale > 0 then
  local skip = {}
  for _, n in ipairs(stale) do
    skip[n] = true
    reply[#reply + 1] = ids[n]
  end
  acked = {}
  for n, id in ipairs(ids) do
    if not skip[n] then acked[#acked + 1] = id end
  end
end
if #acked == 0 then return reply end
variadic('ZREM', KEYS[3], acked)
local unqueued = ready and variadic('ZREM', KEYS[1], ready) or 0 -- a copy the sweep had put back
if #waiting > 0 then unqueued = unqueued + variadic('ZREM', KEYS[2], waiting) end
if retries > 0 then rcall('HINCRBY', KEYS[4], 'retrying', -retries) end
if unqueued > 0 then drop_idle_wake(KEYS[1], KEYS[2], KEYS[8]) end -- its wake may be idle now
reply[1] = variadic('HDEL', KEYS[6], acked)
-- The states and what of the task index and the dedup holds is theirs, in one HDEL: for one
-- message (a lone ack) by forget_one, with no table made (each costs the server more than a
-- call); for more, read in one HMGET, the fields appended to the acked ids themselves
-- (nothing reads them after this; a copy would be one table more).
if #ids == 1 then
  forget_one(KEYS[7], ids[1], parsed[1])
else
  variadic('HDEL', KEYS[7], forgotten_fields(KEYS[7], ids, parsed, acked))
end
if reply[1] > 0 and wake_freed_slot(KEYS[4], KEYS[1], KEYS[2], KEYS[8]) then
  expire_with_meta(KEYS[4], KEYS[8]) -- an ack is no consumer activity: the queue's expiry stays
end
return reply
