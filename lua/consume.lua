#!lua
-- name: consume
-- version: 17
-- summary: Deliver up to N ready messages across several queues, highest priority first, and index them as in flight.
-- KEYS: 8 per queue, repeated for each queue (all queues of one call must share a cluster slot)
--   queue    ZSET    P queue:{Q}           ready messages, score (255 - priority) * 10^13 + ready_at_ms
--   delayed  ZSET    P delayed:{Q}         delayed messages, score = ETA in unix ms
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments; 'expires' (ms) is refreshed on all eight keys; 'paused' (set by pause): nothing of the queue is delivered or promoted; 'limits' = 'IN_FLIGHT RATE' ('-' for unset; set by limit) and the rate's bucket 'limit_tat' (unix microseconds, read and written here only for a queue with a rate); counters 'redelivered', 'retrying' (less those promoted), 'dropped:<reason>' (HINCRBY); a fair queue's virtual clock 'fair' (publish), moved up to the time part of what is taken, and with 'fair:<key>' dropped once nothing is ready
--   dead     STREAM  P dead:{Q}            dead letters: id, reason, delivery_count, priority, payload
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'
--   wake     LIST    P wake:{Q}            the wake token: pushed again when a call leaves ready messages behind that its limits let go
-- ARGV:
--   1  count               integer 1..10000   most messages to deliver
--   2  visibility_ms       integer 1..315360000000  visibility deadline of each delivered message, from now
--   3  no_ack              0 or 1             1: delete each message as it is delivered (nothing is left behind)
--   4  dead_letter_maxlen  integer >= 0       approximate cap of the dead-letter stream; 0 deletes expired messages outright
-- returns: array {wake_in_ms, expired, then 4 items per delivered message: queue_position, id, delivery_count, payload[, rate_in_ms]}
--   wake_in_ms is -1 when none of the queues holds a delayed message or waits for its
--   rate, else the ms until the earliest ETA (0 when one is due) or until the next token
--   of a rate that holds back ready messages (at least 1); expired counts messages whose TTL had passed,
--   dead-lettered (reason 'expired') instead of delivered; queue_position is 1-based in
--   the order of KEYS. rate_in_ms, last and only when a rate holds back ready messages:
--   the ms until its next token (at least 1), which the consumer times itself.
-- errors:
--   ERR celery-redis-lua: consume: expected 8 keys per queue, got N
--   ERR celery-redis-lua: consume: expected 4 arguments, got N
--   ERR celery-redis-lua: consume: key 'K' has no {hash tag}
--   ERR celery-redis-lua: consume: count must be an integer in 1..10000, got 'V'
--   ERR celery-redis-lua: consume: visibility_ms must be an integer in 1..315360000000, got 'V'
--   ERR celery-redis-lua: consume: no_ack must be 0 or 1, got 'V'
--   ERR celery-redis-lua: consume: dead_letter_maxlen must be an integer >= 0, got 'V'
-- why: due delayed messages are promoted here (not only by the periodic sweep) so that
--   they become consumable at their ETA. A message whose TTL passed while it waited is
--   dead-lettered with reason 'expired' and replaced by the next message; at most
--   4 * count + 100 are skipped per call, so one call never runs for long. Consuming is
--   consumer activity: it refreshes the expiry of a queue with x-expires. A call that stops
--   at its count with messages left pushes the wake token, so another blocked consumer
--   takes them (a burst that one consumer's room cannot hold is shared); a queue left with
--   nothing ready or delayed drops its token, so none outlives the messages. A paused
--   queue is left as it is (its countdowns wait too) and drops its token, so its consumers
--   sleep until resume wakes them; the pause is read in the call that would take, so no
--   delivery races it. Limits (the limit script) are read in the same HMGET, so a queue
--   without one pays nothing more. A queue with an in-flight cap delivers at most the cap
--   less what is in flight (stored - ready - delayed), per queue in a call over several,
--   the merge by priority kept; a queue with a rate delivers the tokens of its bucket
--   (GCRA: 'limit_tat' is when the bucket is full again; burst max(1, N / 10)), judged by
--   the server's clock; a consumer late for a token by less than half an interval keeps
--   its place in the schedule, so a late wake does not lower the rate. What a limit holds
--   back costs nothing: no delivery count, no index entry, no token spent. A queue its
--   limit stops drops the wake token instead of pushing it: a freed slot (ack, reject, the sweep) pushes it again, and a rate answers
--   with the time to its next token (rate_in_ms, and in wake_in_ms), so the refused
--   consumer comes back then, timed by itself: the server checks a block's timeout only
--   every 1/hz (100 ms by default), which would hold 10/s to about 6/s. Several consumers
--   waiting on one rate each wake at that time and all but one are refused again: C
--   consumers cost about C consume calls per token, N * C per unit.
--   Writes are variadic where they can be, and a batch's payloads and states are read in one
--   HMGET each per queue, which keeps the server's cost per message low.
--   visibility_ms is at most 10 years (315360000000 ms), so that now plus it stays an exact
--   double and string.format('%d') cannot overflow (protocol/bounds.py).
--   A stored 'expires' past 10 years (an older version's, or set by hand) counts as 10
--   years (stored_ms), so the expiry refresh never overflows string.format('%d').
--   A fair queue (publish's fairness key: 'fair' in meta, read in the same HMGET, so a
--   queue without one pays nothing) is taken by score as any other; its virtual clock V
--   follows what is taken (the largest score's time part, never down), a due delayed message
--   becomes ready at V (a countdown starts as a quiet key would), and a call that leaves it
--   with nothing ready drops the 'fair' fields: the next key starts afresh at now.

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

-- A consumer with nothing to do blocks on the wake list (BLPOP); a token there wakes one,
-- which runs consume. Pushed only into an empty list: one LLEN while a token already waits.
local function arm_wake(wake_key)
  if redis.call('LLEN', wake_key) > 0 then return false end
  redis.call('RPUSH', wake_key, '1')
  return true
end

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: consume: ' .. message)
end

-- One command over many arguments, in chunks that Lua's unpack() can take.
local function variadic(command, key, items)
  for first = 1, #items, 4000 do
    rcall(command, key, unpack(items, first, math.min(first + 3999, #items)))
  end
end

-- An integer argument, or nil. `+ 0` converts once where tonumber converts twice (Lua 5.1
-- checks, then converts): half its instructions (scripts.bench.floor --ops), and the same
-- number, as the pattern lets only digits through.
local function integer(value)
  if not string.find(value, '^%-?%d+$') then return nil end
  return value + 0
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

if #KEYS == 0 or #KEYS % QUEUE_KEYS ~= 0 then return fail('expected 8 keys per queue, got ' .. #KEYS) end
if #ARGV ~= 4 then return fail('expected 4 arguments, got ' .. #ARGV) end
local count = integer(ARGV[1])
if not count or count < 1 or count > 10000 then
  return fail("count must be an integer in 1..10000, got '" .. ARGV[1] .. "'")
end
local visibility = integer(ARGV[2])
if not visibility or visibility <= 0 or visibility > MAX_DURATION_MS then
  return fail("visibility_ms must be an integer in 1.." .. string.format('%d', MAX_DURATION_MS) .. ", got '" ..
              ARGV[2] .. "'")
end
if ARGV[3] ~= '0' and ARGV[3] ~= '1' then return fail("no_ack must be 0 or 1, got '" .. ARGV[3] .. "'") end
local no_ack = ARGV[3] == '1'
local dead_maxlen = integer(ARGV[4])
if not dead_maxlen or dead_maxlen < 0 then
  return fail("dead_letter_maxlen must be an integer >= 0, got '" .. ARGV[4] .. "'")
end

local queues = {}
for q = 1, #KEYS / QUEUE_KEYS do
  local base = QUEUE_KEYS * (q - 1)
  local queue_key = KEYS[base + 1]
  local open = string.find(queue_key, '{', 1, true)
  local close = open and string.find(queue_key, '}', open + 1, true)
  if not close or close == open + 1 then return fail("key '" .. queue_key .. "' has no {hash tag}") end
  queues[q] = {queue = queue_key, delayed = KEYS[base + 2], index = KEYS[base + 3], meta = KEYS[base + 4],
               dead = KEYS[base + 5], message = KEYS[base + 6], state = KEYS[base + 7], wake = KEYS[base + 8],
               base = base, pos = q}
end

-- A paused queue (the pause script) delivers nothing and promotes nothing; the others are
-- consumed as if it were not in the call. The limits come in the same HMGET.
local active = {}
for _, q in ipairs(queues) do
  local meta = rcall('HMGET', q.meta, 'expires', 'paused', 'limits', 'fair')
  q.expires, q.paused, q.limits, q.fair = stored_ms(meta[1]), meta[2] ~= false, meta[3], tonumber(meta[4])
  if not q.paused then active[#active + 1] = q end
end

local time = rcall('TIME')
local seconds, micros = time[1] + 0, time[2] + 0 -- TIME's two integers (`+ 0`: see integer)
local now_us = seconds * 1000000 + micros
local now = (now_us - micros % 1000) / 1000
local deadline = now + visibility

-- 1. Promote due delayed messages, and work out when the next one falls due.
--    The common case (nothing due) costs one ZRANGE per queue.
local wake_in, rate_in = -1, -1
for _, q in ipairs(active) do
  local first = rcall('ZRANGE', q.delayed, 0, 0, 'WITHSCORES')
  if first[2] and tonumber(first[2]) <= now then
    local due = rcall('ZRANGE', q.delayed, '-inf', now, 'BYSCORE', 'LIMIT', 0, count + 100, 'WITHSCORES')
    local promoted, retried = {}, 0
    for i = 1, #due, 2 do
      local id, eta = due[i], tonumber(due[i + 1])
      local raw = rcall('HGET', q.state, id)
      if raw then -- else an orphan: nothing left to deliver
        local s = parse_state(raw)
        rcall('ZADD', q.queue, string.format('%d', (255 - s.priority) * PRIORITY_FACTOR + (q.fair or eta)), id)
        if tonumber(s.expires_at) then rcall('ZADD', q.index, s.expires_at, id) end -- dropped at its TTL
        rcall('HSET', q.state, id, state_line('ready', s.count, s))
        if s.state == 'retry' then retried = retried + 1 end -- a delayed retry (reject, sweep) is due
      end
      promoted[#promoted + 1] = id
    end
    variadic('ZREM', q.delayed, promoted)
    if retried > 0 then rcall('HINCRBY', q.meta, 'retrying', -retried) end
    first = rcall('ZRANGE', q.delayed, 0, 0, 'WITHSCORES')
  end
  q.delayed_left = first[1] ~= nil
  if first[2] then
    local wait = math.max(0, tonumber(first[2]) - now)
    if wake_in < 0 or wait < wake_in then wake_in = wait end
  end
end

-- 2. Limits (the limit script): how many each queue may deliver now (q.room; nil: no
--    limit). In flight is stored - ready - delayed, as stats counts it; a rate's bucket
--    holds burst - (tat - now) / interval tokens, at most burst. A call where no
--    queue has a limit (limited = false) takes as if limits did not exist.
local limited = false
for _, q in ipairs(active) do
  local n, unit
  if q.limits then
    local cap, rate = string.match(q.limits, '^(%S+) (%S+)$')
    q.cap = tonumber(cap)
    if rate then n, unit = string.match(rate, '^(%d+)/([smh])$') end
  end
  if q.cap then
    local in_flight = rcall('HLEN', q.message) - rcall('ZCARD', q.queue) - rcall('ZCARD', q.delayed)
    q.room = math.max(0, q.cap - in_flight)
    limited = true
  end
  if n then
    limited = true
    q.interval = (unit == 's' and 1000000 or unit == 'm' and 60000000 or 3600000000) / tonumber(n) -- us
    q.burst = math.max(1, math.floor(tonumber(n) / 10))
    -- A consumer late for its token by less than half an interval keeps the token's place
    -- (tat is left in the past): with a burst of 1, moving tat up to now would lose every
    -- wake's lateness for good. The bucket still holds at most `burst` tokens, and no
    -- window more than one token beyond the strict bucket's count; one idle longer starts
    -- afresh at now.
    q.tat = tonumber(rcall('HGET', q.meta, 'limit_tat')) or 0
    if q.tat <= now_us - q.interval / 2 then q.tat = now_us end
    q.tokens = math.max(0, math.floor(q.burst - (q.tat - now_us) / q.interval + 1e-9))
    q.room = math.min(q.room or q.tokens, q.tokens)
  end
end

-- 3. Take up to `need` ids off the queues, lowest score (highest priority, then oldest)
--    first across queues, none from a queue beyond its room. One queue: ZPOPMIN. Several:
--    merge their heads, then ZREM. A queue found empty is marked so (q.empty). Returns
--    what it took, flat: each queue's position in KEYS and the id, in turn (no table per
--    message: each one costs the server), and whether every queue is now empty (without
--    limits; with them, the caller asks again until nothing comes).
local function take(need)
  local taken, open = {}, active
  if limited then
    open = {}
    for _, q in ipairs(active) do
      if not q.empty and q.room ~= 0 then open[#open + 1] = q end
    end
  end
  if #open == 0 then return taken, not limited end
  if #open == 1 then
    local q = open[1]
    local n = q.room and math.min(need, q.room) or need
    local popped = rcall('ZPOPMIN', q.queue, n)
    for i = 1, #popped, 2 do taken[i], taken[i + 1] = q.pos, popped[i] end -- popped: id, score, ...
    if q.fair and #popped > 0 then q.top = tonumber(popped[#popped]) end -- the largest score taken
    if limited then q.empty = #popped < 2 * n return taken, false end
    return taken, #popped < 2 * need
  end
  local heads, positions, asked = {}, {}, {}
  for i, q in ipairs(open) do
    asked[i] = q.room and math.min(need, q.room) or need
    heads[i] = rcall('ZRANGE', q.queue, 0, asked[i] - 1, 'WITHSCORES')
    positions[i] = 1
  end
  local removed = {}
  while #taken < 2 * need do
    local best, best_score
    for i = 1, #open do
      local score = tonumber(heads[i][positions[i] + 1])
      if score and (not best or score < best_score) then best, best_score = i, score end
    end
    if not best then break end
    local id = heads[best][positions[best]]
    positions[best] = positions[best] + 2
    local n = #taken
    taken[n + 1], taken[n + 2] = open[best].pos, id
    if open[best].fair then open[best].top = best_score end -- each queue's heads come in order
    removed[best] = removed[best] or {}
    table.insert(removed[best], id)
  end
  for i, ids in pairs(removed) do variadic('ZREM', open[i].queue, ids) end
  if not limited then return taken, #taken < 2 * need end
  for i, q in ipairs(open) do -- every head taken, and fewer than asked for: nothing is left
    if #heads[i] < 2 * asked[i] and positions[i] > #heads[i] then q.empty = true end
  end
  return taken, false
end

-- The payloads and state strings of what `take` took (false where gone), in its order: one
-- HMGET of each per queue (in chunks that Lua's unpack() can take), not an HGET of each per
-- message (a call costs more than a field).
local function read_taken(taken)
  if #queues == 1 and #taken <= 8000 then -- most calls: the replies are in `taken`'s order
    local ids, q = {}, queues[1]
    for k = 2, #taken, 2 do ids[k / 2] = taken[k] end
    return rcall('HMGET', q.message, unpack(ids)), rcall('HMGET', q.state, unpack(ids))
  end
  local ids, places, payloads, raws = {}, {}, {}, {} -- queue position -> its ids, their places in `taken`
  for k = 1, #taken, 2 do
    local pos, id, i = taken[k], taken[k + 1], (k + 1) / 2
    local mine = ids[pos]
    if not mine then
      ids[pos], places[pos] = {id}, {i}
    else
      local n = #mine + 1
      mine[n], places[pos][n] = id, i
    end
  end
  for pos, mine in pairs(ids) do
    local q, place = queues[pos], places[pos]
    for first = 1, #mine, 4000 do
      local last = math.min(first + 3999, #mine)
      local found, states = rcall('HMGET', q.message, unpack(mine, first, last)),
                            rcall('HMGET', q.state, unpack(mine, first, last))
      for k = first, last do payloads[place[k]], raws[place[k]] = found[k - first + 1], states[k - first + 1] end
    end
  end
  return payloads, raws
end

local function dead_letter_expired(q, id, s, payload)
  if dead_maxlen > 0 then
    rcall('XADD', q.dead, 'MAXLEN', '~', dead_maxlen, '*', 'id', id, 'reason', 'expired',
          'delivery_count', s.count, 'priority', s.priority, 'payload', payload)
  end
end

-- 4. Deliver what was taken: stamp the deadline (or delete, without ack). An id whose TTL
--    passed is dead-lettered, one without a message is an orphan; both are replaced by
--    more from the queues, a bounded number of times.
local reply = {wake_in, 0}
local delivered, expired, drained = 0, 0, false
local skips_left = 4 * count + 100
local deadline_text = string.format('%d', deadline) -- each delivery's index score
while skips_left > 0 do
  local taken, exhausted = take(count - delivered)
  if #taken == 0 then drained = exhausted break end -- every queue is empty, or at its limit
  -- A batch's payloads and states are read at once and its state strings written at once; a
  -- single message's by HGET and HSET, as many calls and no tables (each costs the server).
  local deadlines, gone, payloads, raws, lines = nil, nil, nil, nil, nil
  if #taken > 2 then
    payloads, raws = read_taken(taken)
    lines, deadlines = {}, {} -- queue -> the state strings to write, and their index entries
  end
  for t = 1, #taken, 2 do -- taken: position, id, position, id ...
    local i, pos, id = (t + 1) / 2, taken[t], taken[t + 1]
    local q = queues[pos]
    local found, raw
    if payloads then
      found, raw = payloads[i], raws[i]
    else
      found, raw = rcall('HGET', q.message, id), rcall('HGET', q.state, id)
    end
    local s = raw and parse_state(raw)
    local at = s and s.expires_at ~= '-' and tonumber(s.expires_at) -- '-': no TTL, and no conversion
    local skipped = not found or not s or (at and at <= now)
    if skipped and found and s then
      dead_letter_expired(q, id, s, found)
      expired = expired + 1
      q.expired = (q.expired or 0) + 1
    end
    if skipped or no_ack then -- it goes: an orphan, expired, or delivered without an ack
      rcall('HDEL', q.message, id)
      forget_task(q.state, id, s)
      rcall('HDEL', q.state, id)
      gone = gone or {}
      gone[q] = gone[q] or {}
      table.insert(gone[q], id)
    end
    if skipped then
      skips_left = skips_left - 1
    else
      if not no_ack then
        local unacked = state_line('unacked', s.count, s)
        local entries = lines and deadlines[q]
        if not lines then -- a single message: written at once, with no table
          rcall('HSET', q.state, id, unacked)
          rcall('ZADD', q.index, deadline_text, id)
        elseif entries then
          local k = #entries
          entries[k + 1], entries[k + 2] = deadline_text, id
          entries = lines[q]
          entries[k + 1], entries[k + 2] = id, unacked -- as long as deadlines[q]
        else
          deadlines[q], lines[q] = {deadline_text, id}, {id, unacked} -- sized at once (filling grows twice)
        end
      end
      local r = #reply
      reply[r + 1], reply[r + 2], reply[r + 3], reply[r + 4] = pos, id, s.count, found
      delivered = delivered + 1
      if q.room then q.room, q.delivered = q.room - 1, (q.delivered or 0) + 1 end
    end
  end
  if gone then
    for q, ids in pairs(gone) do variadic('ZREM', q.index, ids) end
  end
  if lines then
    for q, entries in pairs(deadlines) do variadic('ZADD', q.index, entries) end
    for q, entries in pairs(lines) do variadic('HSET', q.state, entries) end
  end
  if exhausted then drained = true break end -- every queue of the call is empty
  if delivered >= count then break end
end
reply[2] = expired
-- A rate spends one token per delivery (refused and expired ones spend none).
if limited then
  for _, q in ipairs(active) do
    if q.interval and q.delivered then
      q.tat = q.tat + q.delivered * q.interval
      rcall('HSET', q.meta, 'limit_tat', string.format('%d', math.ceil(q.tat)))
    end
  end
end
-- What is left wakes another consumer (a call that stopped at its count, or its skips);
-- a queue left with nothing to wake anyone for, or paused, drops its token, and so does
-- one its limit holds back: a freed slot pushes it again (ack, reject, sweep), and a rate
-- out of tokens tells this consumer when its next one comes (wake_in_ms).
for _, q in ipairs(queues) do
  if q.paused then
    rcall('DEL', q.wake)
  elseif drained or q.empty or rcall('ZCARD', q.queue) == 0 then
    q.drained = true
    if not q.delayed_left then rcall('DEL', q.wake) end
  elseif q.room == 0 then
    rcall('DEL', q.wake)
    if q.interval and q.tokens <= (q.delivered or 0) then
      local wait = math.max(1, math.ceil((q.tat - (q.burst - 1) * q.interval - now_us) / 1000))
      if wake_in < 0 or wait < wake_in then wake_in = wait end
      if rate_in < 0 or wait < rate_in then rate_in = wait end
    end
  else
    arm_wake(q.wake)
  end
end
reply[1] = wake_in
if rate_in >= 0 then reply[#reply + 1] = rate_in end

-- 5. A fair queue's virtual clock follows what was taken (the time part of the largest
--    score, never down); one left with nothing ready forgets its keys (HKEYS once per
--    drain: the fields are at most the keys seen since the last one).
for _, q in ipairs(active) do
  if q.fair and q.drained then
    local names, fair = rcall('HKEYS', q.meta), {}
    for _, name in ipairs(names) do
      if name == 'fair' or string.sub(name, 1, 5) == 'fair:' then fair[#fair + 1] = name end
    end
    variadic('HDEL', q.meta, fair)
  elseif q.fair and q.top then
    local at = q.top - math.floor(q.top / PRIORITY_FACTOR) * PRIORITY_FACTOR
    if at > q.fair then rcall('HSET', q.meta, 'fair', string.format('%d', at)) end
  end
end

-- 6. Consuming keeps a queue with x-expires alive, all eight keys at once.
for _, q in ipairs(queues) do
  count_in_meta(q.meta, 'dropped:expired', q.expired or 0)
  if q.expires then
    local at = string.format('%d', now + q.expires) -- one absolute time: the keys expire together
    for i = 1, QUEUE_KEYS do rcall('PEXPIREAT', KEYS[q.base + i], at) end
  end
end
return reply
