#!lua
-- name: publish
-- version: 17
-- summary: Store messages in one queue, one or a batch: each ready at once, or delayed until an absolute ETA.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages, score (255 - priority) * 10^13 + ready_at_ms
--   delayed  ZSET    P delayed:{Q}         delayed messages, score = ETA in unix ms
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again; 'dedup:<sha1>' -> the end of a throttle window (the sweep drops the hold)
--   meta     HASH    P meta:{Q}            queue arguments (expires, message_ttl, max_priority), last_id, 'paused' (no wake token then), 'limits' (set by limit: no wake token for a ready message at the in-flight cap); a fair queue's virtual clock 'fair' (ms) and each fairness key's next start tag 'fair:<key>'
--   dead     STREAM  P dead:{Q}            dead letters (only its expiry is refreshed here)
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'; the task-id index 'task:<task id>' -> id; a dedup id's hold 'dedup:<sha1 of the id>' -> 'HOLDER UNTIL_MS|- MODE ID'
--   wake     LIST    P wake:{Q}            the wake token: pushed when the list is empty, for a consumer blocked on BLPOP
-- ARGV:
--   1  payload        string, non-empty                    the kombu envelope, stored unchanged
--   2  priority       integer 0..255                       higher is delivered first; '' means 0; capped by the queue's max_priority
--   3  eta_ms         integer 0..9999999999999             absolute unix ms by the server's clock; '' or 0 means now
--   4  ttl_ms         integer 1..315360000000 or -1        message TTL in ms (at most 10 years), counted while it waits (from its ETA when delayed); '' or -1 means none; the queue's message_ttl wins when shorter
--   5  visibility_ms  integer > 0                          unused since version 8 (no ready message sits popped); still checked, so version 7 callers need no change
--   6  task_id        string, optional, at most 256 bytes  the Celery task id (the envelope's headers.id): indexed so that where and cancel find the message; '' or absent: not indexed
--   7  exchange       string, optional, with 8             the exchange a cached route to this queue came from
--   8  routed_ms      integer >= 0, optional, with 7       the binding table server's unix ms when that route was looked up (lookup's first reply)
--   9  dedup_id       string, optional, 1..512 bytes       with 10 and 11 (7 and 8 may then be '': no route): a second publish of the same id to this queue is deduplicated by mode
--  10  dedup_mode     'simple', 'throttle' or 'debounce'   simple: dropped while the holder waits or runs; throttle: dropped for dedup_ttl_ms after the first; debounce: the newest replaces the holder while it waits (ready, delayed or waiting for a retry)
--  11  dedup_ttl_ms   integer 1..315360000000 or ''        how long a hold lasts at most (required for throttle); '' means until the holder goes
--  12  fairness_key   string, optional, at most 256 bytes  the tenant: the queue becomes fair (7-11 may then be ''); within a priority a ready message is scored by its key's start tag max(V, F[key]), not by now; '' means none
--  a batch: 2..1000 messages in 12 arguments each (24, 36, ... arguments), each as 1-12 above; stored as as many
--      publishes in a row would store them, at one server time, in one call (a producer's group commit);
--      every message is checked first: a bad one refuses the call, its error naming it ('publish: message 3: ...')
-- returns: for one message: bulk string, the new message id: 14 hex digits, 13 of server unix microseconds and 1 of a counter;
--   with a task_id whose indexed message holds the same payload, that message's id (nothing is written);
--   with a dedup id held (simple, throttle), the array ['deduplicated', holder id] (nothing is written but
--   meta's counter 'deduplicated:<mode>'); a debounce that replaced the waiting holder: ['replaced', new id,
--   replaced id] (the replaced message is gone, not dead-lettered; counted as 'deduplicated:debounce');
--   with a cached route (7, 8) older than the queue's last binding change for that exchange (rerouted),
--   or to a queue that does not exist, the array ['stale-route', changed_ms or -1] (nothing is written);
--   for a batch: an array of the replies, one per message in order, each as above
-- errors:
--   ERR celery-redis-lua: publish: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: publish: expected 5, 6, 8, 11 or 12 arguments, or 12 per message for 2..1000 messages, got N
--   ERR celery-redis-lua: publish: key 'K' has no {hash tag}
--   ERR celery-redis-lua: publish: payload is missing or empty
--   ERR celery-redis-lua: publish: priority must be an integer in 0..255, got 'V'
--   ERR celery-redis-lua: publish: eta_ms must be an integer in 0..9999999999999, got 'V'
--   ERR celery-redis-lua: publish: ttl_ms must be an integer in 1..315360000000 or -1, got 'V'
--   ERR celery-redis-lua: publish: visibility_ms must be a positive integer, got 'V'
--   ERR celery-redis-lua: publish: task_id must be at most 256 bytes, got N
--   ERR celery-redis-lua: publish: exchange must be non-empty with routed_ms
--   ERR celery-redis-lua: publish: routed_ms must be a non-negative integer, got 'V'
--   ERR celery-redis-lua: publish: dedup_id must be 1..512 bytes, got N
--   ERR celery-redis-lua: publish: dedup_mode must be simple, throttle or debounce, got 'V'
--   ERR celery-redis-lua: publish: dedup_ttl_ms must be an integer in 1..315360000000 or '', got 'V'
--   ERR celery-redis-lua: publish: dedup_ttl_ms is required with dedup_mode throttle
--   ERR celery-redis-lua: publish: fairness_key must be at most 256 bytes, got N
-- why: ids grow with the server's clock, so an id is never used twice for one queue name,
--   even after the queue expired or was deleted (a late ack of an old delivery cannot
--   touch a new message), and messages of one priority come out in publish order (equal
--   ZSET scores fall back to member order). No consumer pops a message with a blocking
--   command: one with nothing to do blocks on the wake list, and publish pushes a token
--   there when it is empty, so the consumer runs consume, which takes the message and marks
--   it in flight in one step. So a ready message needs no index entry; one with a TTL gets
--   an entry at its TTL, and the sweep dead-letters it if it expires unconsumed. A delayed
--   message wakes a consumer the same way, so it learns when to look again. A queue with
--   x-expires has all eight keys expire together, messages included. A publish of a task id
--   whose message is still in the queue with the very same payload stores nothing: kombu
--   retries a publish whose reply a dropped connection lost, and the first copy may have
--   landed (a Celery retry carries other headers, so it is a new message). A route looked
--   up in the very millisecond of the change is refused too (it may have come before it).
--   Every time it computes stays an exact double below 10^13 ms: an ETA by its bound, a TTL
--   of at most 10 years; a queue's stored expires or message_ttl past 10 years (an older
--   version's, or set by hand) counts as 10 years. A dedup id's hold is a field of the state
--   hash, so it lives and expires with the queue; the holder's state string carries the id's
--   sha1, so the script that settles the holder (ack, reject, sweep, consume, cancel, purge)
--   releases the hold with no call more for a message without one. A throttle window outlives
--   its holder: it is indexed at its end, where the sweep drops it. A batch costs its calls
--   once, not once per message (one TIME, one HMGET of meta and one of the task index, one HSET
--   or ZADD per key): what a producer's group commit saves is most of a publish's cost. A
--   message with a dedup id reads its hold from the server, so what the batch gathered before
--   it is written first. Lua's allocations are a large part of a publish's cost in Redis (each
--   table, closure and upvalue, and its collection over every loaded script), so the loop is
--   written out, not made of functions over the call's state, and a single message builds
--   only what a batch needs too. A single message without a dedup id is written at once, one
--   HSET or ZADD per key as a batch's, without the lists a batch gathers (8% of its cost),
--   and its task index entry is read by HGET.

local rcall = redis.call
local PRIORITY_FACTOR = 10000000000000 -- 10^13 ms per priority level (317 years)
local MAX_ETA_MS = PRIORITY_FACTOR - 1 -- a later ETA would overflow into the next priority band
local MAX_DURATION_MS = 315360000000 -- 10 years in ms, the longest duration taken or read back (bounds.py)
local MAX_BATCH = 1000 -- messages per call: 12,000 arguments, and each HSET within Lua's unpack limit (8,000)

-- A duration stored in meta (ms), as the scripts apply it: one past MAX_DURATION_MS (an
-- older version took any integer, or a hand set it) counts as MAX_DURATION_MS, longer than
-- anything waits, instead of overflowing the sums with the clock; not a positive integer:
-- nil, not set.
local function stored_ms(value)
  local n = value and string.match(value, '^%d+$') and tonumber(value)
  if not n or n < 1 then return nil end
  return math.min(n, MAX_DURATION_MS)
end

-- A consumer with nothing to do blocks on the wake list (BLPOP); a token there wakes one,
-- which runs consume. Pushed only into an empty list: one LLEN while a token already waits.
local function arm_wake(wake_key)
  if redis.call('LLEN', wake_key) > 0 then return false end
  redis.call('RPUSH', wake_key, '1')
  return true
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

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: publish: ' .. message)
end

-- The id after `last_id` (nil for none): 13 hex digits of server microseconds and 1 of a
-- counter within one, never below the last one (the same microsecond, or a clock that
-- stepped back). Three script calls (publish, delete, publish) cannot share one
-- microsecond, so a queue declared again after a delete or expiry never reuses an id.
-- 14 characters, not 16: Redis keeps a string of up to 14 in a 16-byte allocation, and
-- the id is stored four times per message (66 bytes less per message on Redis 7.0).
-- 13 digits of microseconds last until 2112.
local function next_id(last_id, now_us)
  local last_us = last_id and tonumber(string.sub(last_id, 1, 13), 16)
  if not last_us or last_us < now_us then return string.format('%013x0', now_us) end -- a clock that moved on
  local id_us, counter = last_us, (tonumber(string.sub(last_id, 14), 16) or 0) + 1
  if counter > 0xF then id_us, counter = id_us + 1, 0 end
  return string.format('%013x%x', id_us, counter)
end

-- An integer argument ('' is `default`), or nil. `+ 0` converts once where tonumber converts
-- twice (Lua 5.1 checks, then converts): half its instructions (scripts.bench.floor --ops),
-- and the same number, as the pattern lets only digits through.
local function integer(value, default)
  if value == '' then return default end
  if not string.find(value, '^%-?%d+$') then return nil end
  return value + 0
end

-- The message whose `width` arguments start after ARGV[base], checked; nil and the error's
-- text for a bad one (`label` names the message of a batch).
local function parse(base, width, label)
  local payload, task_id = ARGV[base + 1], ARGV[base + 6] or ''
  if payload == '' then return nil, label .. 'payload is missing or empty' end
  local priority = integer(ARGV[base + 2], 0)
  if not priority or priority < 0 or priority > 255 then
    return nil, label .. "priority must be an integer in 0..255, got '" .. ARGV[base + 2] .. "'"
  end
  local eta = integer(ARGV[base + 3], 0)
  if not eta or eta < 0 or eta > MAX_ETA_MS then
    return nil, label .. "eta_ms must be an integer in 0.." .. string.format('%d', MAX_ETA_MS) .. ", got '" ..
                ARGV[base + 3] .. "'"
  end
  local ttl = integer(ARGV[base + 4], -1)
  if not ttl or (ttl <= 0 and ttl ~= -1) or ttl > MAX_DURATION_MS then
    return nil, label .. "ttl_ms must be an integer in 1.." .. string.format('%d', MAX_DURATION_MS) ..
                " or -1, got '" .. ARGV[base + 4] .. "'"
  end
  local visibility = integer(ARGV[base + 5], nil)
  if not visibility or visibility <= 0 then
    return nil, label .. "visibility_ms must be a positive integer, got '" .. ARGV[base + 5] .. "'"
  end
  if #task_id > 256 then return nil, label .. 'task_id must be at most 256 bytes, got ' .. #task_id end

  local exchange, routed = width >= 8 and ARGV[base + 7] or nil, nil
  if exchange == '' and width >= 11 and ARGV[base + 8] == '' then exchange = nil end -- dedup or a key, no route
  if exchange then
    if exchange == '' then return nil, label .. 'exchange must be non-empty with routed_ms' end
    routed = string.match(ARGV[base + 8], '^%d+$') and tonumber(ARGV[base + 8])
    if not routed then
      return nil, label .. "routed_ms must be a non-negative integer, got '" .. ARGV[base + 8] .. "'"
    end
  end

  local dedup_id, mode, hold_ttl = width >= 11 and ARGV[base + 9] or nil, ARGV[base + 10], nil
  if dedup_id == '' and mode == '' and ARGV[base + 11] == '' and width == 12 then dedup_id = nil end -- a key alone
  if dedup_id then
    if #dedup_id < 1 or #dedup_id > 512 then return nil, label .. 'dedup_id must be 1..512 bytes, got ' .. #dedup_id end
    if mode ~= 'simple' and mode ~= 'throttle' and mode ~= 'debounce' then
      return nil, label .. "dedup_mode must be simple, throttle or debounce, got '" .. mode .. "'"
    end
    hold_ttl = integer(ARGV[base + 11], -1)
    if not hold_ttl or (hold_ttl <= 0 and hold_ttl ~= -1) or hold_ttl > MAX_DURATION_MS then
      return nil, label .. "dedup_ttl_ms must be an integer in 1.." .. string.format('%d', MAX_DURATION_MS) ..
                  " or '', got '" .. ARGV[base + 11] .. "'"
    end
    if hold_ttl == -1 and mode == 'throttle' then
      return nil, label .. 'dedup_ttl_ms is required with dedup_mode throttle'
    end
  end

  local key = width >= 12 and ARGV[base + 12] or ''
  if #key > 256 then return nil, label .. 'fairness_key must be at most 256 bytes, got ' .. #key end
  -- The common fields in the constructor, the rare ones after: a publish pays for each
  -- byte its tables take (the allocation and Lua's collection, over every script loaded).
  local m = {payload = payload, priority = priority, eta = eta, ttl = ttl, task = task_id, own = 'fair:' .. key}
  if exchange then m.exchange, m.routed = exchange, routed end
  if dedup_id then
    m.dedup_id, m.dedup_mode, m.dedup_ttl, m.hold = dedup_id, mode, hold_ttl, 'dedup:' .. redis.sha1hex(dedup_id)
  end
  if key ~= '' then m.key = key end
  return m
end

-- Two values onto `list` (nil: a new one), returned: what a call gathers for one HSET or
-- ZADD per key, for every message it stores.
local function push(list, a, b)
  if not list then return {a, b} end -- sized once, where filling an empty table grows it twice
  local n = #list
  list[n + 1], list[n + 2] = a, b
  return list
end

-- Sends what a call gathered (the lists of push; nil: nothing for that key).
local function send(to_message, to_state, to_ready, to_delayed, to_index)
  rcall('HSET', KEYS[6], unpack(to_message))
  rcall('HSET', KEYS[7], unpack(to_state))
  if to_ready then rcall('ZADD', KEYS[1], unpack(to_ready)) end
  if to_delayed then rcall('ZADD', KEYS[2], unpack(to_delayed)) end
  if to_index then rcall('ZADD', KEYS[3], unpack(to_index)) end
end

-- A dedup id held by a message of this queue: the hold is open until its end (UNTIL), and
-- for simple and debounce while its holder is stored (a throttle window outlives it).
-- Returns the reply of a dropped message, or nil and the id of the holder a debounce replaced.
local function settle_hold(m, now)
  local queue_key, delayed_key, index_key, meta_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
  local message_key, state_key = KEYS[6], KEYS[7]
  local held = rcall('HGET', state_key, m.hold)
  local holder, until_ms, kind
  if held then holder, until_ms, kind = string.match(held, '^(%S+) (%S+) (%a+)') end
  local holds = holder and (until_ms == '-' or (tonumber(until_ms) or 0) > now)
  local line = holds and rcall('HGET', state_key, holder) -- false: the holder went
  if holds and not line and kind ~= 'throttle' then holds = false end -- its settle released it
  if not holds then return nil end
  local s = line and parse_state(line)
  if m.dedup_mode == 'debounce' and s and s.state ~= 'unacked' then
    rcall('HDEL', message_key, holder)
    forget_task(state_key, holder, s)
    rcall('HDEL', state_key, holder)
    rcall('ZREM', s.state == 'ready' and queue_key or delayed_key, holder)
    rcall('ZREM', index_key, holder)
    if s.state == 'retry' then rcall('HINCRBY', meta_key, 'retrying', -1) end
    rcall('HINCRBY', meta_key, 'deduplicated:debounce', 1)
    return nil, holder
  elseif m.dedup_mode ~= 'debounce' then
    rcall('HINCRBY', meta_key, 'deduplicated:' .. m.dedup_mode, 1)
    return {'deduplicated', holder}
  end
  return nil -- a debounce while the holder runs (or after a throttle's holder went): stored, and holds
end

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
-- One message in 5-12 arguments, or several in 12 each.
local n, width = 1, #ARGV
if #ARGV > 12 and #ARGV % 12 == 0 and #ARGV <= 12 * MAX_BATCH then
  n, width = #ARGV / 12, 12
elseif #ARGV ~= 5 and #ARGV ~= 6 and #ARGV ~= 8 and #ARGV ~= 11 and #ARGV ~= 12 then
  return fail('expected 5, 6, 8, 11 or 12 arguments, or 12 per message for 2..' .. MAX_BATCH .. ' messages, got ' ..
              #ARGV)
end
local queue_key, delayed_key, meta_key = KEYS[1], KEYS[2], KEYS[4]
local message_key, state_key, wake_key = KEYS[6], KEYS[7], KEYS[8]
local open = string.find(queue_key, '{', 1, true)
local close = open and string.find(queue_key, '}', open + 1, true)
if not close or close == open + 1 then return fail("key '" .. queue_key .. "' has no {hash tag}") end

-- Every message is checked before anything is written: a bad one refuses the whole call.
local messages = {}
for i = 1, n do
  local m, problem = parse((i - 1) * width, width, n > 1 and 'message ' .. i .. ': ' or '')
  if not m then return fail(problem) end
  messages[i] = m
end

local time = rcall('TIME')
local seconds, micros = time[1] + 0, time[2] + 0 -- TIME's two integers (`+ 0`: see integer)
local now_us = seconds * 1000000 + micros
local now = (now_us - micros % 1000) / 1000

-- Queue arguments declared by consumers apply to every producer; one HMGET for the call:
-- the fixed fields, then each message's fairness tag ('fair:<key>', '' for none) and route;
-- and one of the task index for the messages' task ids. `at`: a field's place in its reply.
-- (The tables are made at their size where it is known: each growth is an allocation.)
local own = messages[1].own
local fields = {'expires', 'message_ttl', 'max_priority', 'last_id', 'paused', 'limits', 'fair', own}
local tasks, at = nil, {[own] = 8}
for i = 1, n do
  local m = messages[i]
  if not at[m.own] then fields[#fields + 1], at[m.own] = m.own, #fields + 1 end
  local route = m.exchange and 'route:' .. m.exchange
  if route and not at[route] then fields[#fields + 1], at[route] = route, #fields + 1 end
  if m.task ~= '' then
    m.index = 'task:' .. m.task
    -- A batch reads its task index in one HMGET; one message by an HGET in the loop, which
    -- makes a string, not the two tables of a list and its reply.
    if n > 1 and not tasks then
      tasks, at[m.index] = {m.index}, 1
    elseif n > 1 and not at[m.index] then
      tasks[#tasks + 1], at[m.index] = m.index, #tasks + 1
    end
  end
end
local meta = rcall('HMGET', meta_key, unpack(fields))
local expires, queue_ttl, max_priority, last_id = stored_ms(meta[1]), stored_ms(meta[2]), tonumber(meta[3]), meta[4]
local paused, cap = meta[5] ~= false, meta[6] and tonumber(string.match(meta[6], '^(%d+) '))
local clock = tonumber(meta[7]) -- a fair queue's virtual clock V (nil: the queue is not fair)
local tags -- 'fair:<key>' -> its next start tag, as this call moves it (a fair queue's)
local indexed = tasks and rcall('HMGET', state_key, unpack(tasks)) -- the task index before this call

-- Each message stored as a publish of its own would store it, at the call's time, its
-- writes gathered: one HSET or ZADD per key for the call, sent before a message with a
-- dedup id is looked at (its hold is read from the server) and at the end. The loop is
-- written out here, not as functions over the call's state: a publish pays for every table,
-- closure and upvalue it makes, and that cost was a third of a single publish's.
local to_message, to_state, to_ready, to_delayed, to_index
local pending -- task id -> the message stored for it, in a batch: the index as the unsent writes leave it
local first_id, armed, in_flight = last_id, false, nil
local replies = n > 1 and {} or nil
local reply
for i, m in ipairs(messages) do
  repeat -- `break`: `reply` is the message's answer
    -- A cached route: refused when the bindings to this queue changed since (or the queue is
    -- gone: declare and the first publish set last_id, so no last_id means no queue).
    if m.routed then
      local changed = tonumber(meta[at['route:' .. m.exchange]])
      if not last_id or (changed and changed >= m.routed) then
        reply = {'stale-route', changed or -1}
        break
      end
    end
    local priority, ttl, eta = m.priority, m.ttl, m.eta
    if max_priority and priority > max_priority then priority = max_priority end
    if queue_ttl and (ttl == -1 or queue_ttl < ttl) then ttl = queue_ttl end

    -- The same message again (kombu retrying a publish whose reply a dropped connection
    -- lost): the copy already stored is the answer, not a second one.
    if m.index then
      local unsent = pending and pending[m.task]
      local stored
      if unsent then
        stored = unsent.payload == m.payload and unsent.id
      else
        if indexed then stored = indexed[at[m.index]] else stored = rcall('HGET', state_key, m.index) end
        stored = stored and rcall('HGET', message_key, stored) == m.payload and stored
      end
      if stored then
        reply = stored
        break
      end
    end

    local replaced
    if m.hold then -- what was gathered goes first: the hold is read from the server
      if to_message then
        send(to_message, to_state, to_ready, to_delayed, to_index)
        to_message, to_state, to_ready, to_delayed, to_index = nil, nil, nil, nil, nil
        pending, indexed = nil, nil -- what was sent is read back from the server from now on
      end
      local dropped
      dropped, replaced = settle_hold(m, now)
      if dropped then
        reply = dropped
        break
      end
    end

    -- The token first: its LLEN is this script's last check of a key's type, so a wake key
    -- someone overwrote refuses the publish before anything of the message is written. A
    -- paused queue wakes nobody (resume does), nor does a ready message of a queue at its
    -- in-flight cap (the limit script): a consumer woken now would only be refused, and
    -- the ack, reject or sweep that frees a slot pushes the token then. Once armed, the
    -- token stays for the rest of the call (no consumer runs meanwhile), and a publish
    -- moves nothing in flight.
    if not armed and not paused then
      if cap and eta <= now then
        in_flight = in_flight or rcall('HLEN', message_key) - rcall('ZCARD', queue_key) - rcall('ZCARD', delayed_key)
      end
      if not (cap and eta <= now and in_flight >= cap) then
        arm_wake(wake_key)
        armed = true
      end
    end
    local id = next_id(last_id, now_us)
    last_id = id
    -- A fair queue: the start tag max(V, F[key]) in place of now, F[key] moved past it, and
    -- V set by the first key; a delayed message charges no key (it becomes ready at V).
    local score_at = now
    if m.key or clock then
      clock = clock or now
      tags = tags or {fair = string.format('%d', clock)}
      if eta <= now then
        score_at = math.max(clock, tonumber(tags[m.own] or meta[at[m.own]]) or 0)
        tags[m.own] = string.format('%d', score_at + 1)
      end
    end

    local ready_at = math.max(eta, now)
    local expires_at = ttl > 0 and string.format('%d', ready_at + ttl) or '-'
    local releases = m.hold and m.dedup_mode ~= 'throttle' -- the holder's settle ends the hold
    -- The state string parse_state reads back (the other scripts' state_line), in one
    -- concatenation: a number joined with `..` is printed as a float, '%d' as an integer.
    local line = (eta > now and 'delayed 0 ' or 'ready 0 ') .. string.format('%d', priority) .. ' ' .. expires_at ..
                 (releases and ':' .. string.sub(m.hold, 7) or '') .. (m.task ~= '' and ' ' .. m.task or '')
    local score = eta > now and string.format('%d', eta) or
                  string.format('%d', (255 - priority) * PRIORITY_FACTOR + score_at)
    if not replies and not m.hold then -- one message: written at once (for one, lists cost more than they save)
      rcall('HSET', message_key, id, m.payload)
      if m.index then rcall('HSET', state_key, id, line, m.index, id) else rcall('HSET', state_key, id, line) end
      rcall('ZADD', eta > now and delayed_key or queue_key, score, id)
      if eta <= now and ttl > 0 then rcall('ZADD', KEYS[3], expires_at, id) end -- the sweep drops it at its TTL
      reply = id
      break
    end
    to_message = push(to_message, id, m.payload)
    to_state = push(to_state, id, line)
    if m.hold then -- the message, its task index and the hold in one HSET
      local until_ms = m.dedup_ttl > 0 and string.format('%d', now + m.dedup_ttl) or '-'
      to_state = push(to_state, m.hold, id .. ' ' .. until_ms .. ' ' .. m.dedup_mode .. ' ' .. m.dedup_id)
      if m.dedup_mode == 'throttle' then to_index = push(to_index, until_ms, m.hold) end -- the sweep drops it then
    end
    if m.index then -- a later message of the same task id (a retry) takes the index over
      to_state = push(to_state, m.index, id)
      if replies then
        m.id = id
        pending = pending or {}
        pending[m.task] = m
      end
    end
    if eta > now then
      to_delayed = push(to_delayed, score, id)
    else
      to_ready = push(to_ready, score, id)
      if ttl > 0 then to_index = push(to_index, expires_at, id) end -- the sweep drops it at its TTL
    end
    reply = replaced and {'replaced', id, replaced} or id
  until true
  if replies then replies[i] = reply end
end

if to_message then send(to_message, to_state, to_ready, to_delayed, to_index) end
if last_id ~= first_id then -- something was stored
  if tags then
    local changes = {'last_id', last_id}
    for name, value in pairs(tags) do changes[#changes + 1], changes[#changes + 2] = name, value end
    rcall('HSET', meta_key, unpack(changes))
  else
    rcall('HSET', meta_key, 'last_id', last_id)
  end
  if expires then
    local at_ms = string.format('%d', now + expires) -- one absolute time: the keys expire together
    for i = 1, 8 do rcall('PEXPIREAT', KEYS[i], at_ms) end
  end
end
return replies or reply
