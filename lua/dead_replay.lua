#!lua
-- name: dead_replay
-- version: 11
-- summary: Move dead letters of one queue back into it as fresh ready messages (delivery count 0).
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages (expiry refresh only)
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments and last_id; 'paused' is read, and a fair queue's virtual clock 'fair' (publish), at which a replayed message is ready
--   dead     STREAM  P dead:{Q}            dead letters: id, reason, delivery_count, priority, payload
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'; the task-id index 'task:<task id>' -> id
--   wake     LIST    P wake:{Q}            the wake token: pushed when replayed messages are ready (not in a paused queue: none is delivered)
-- ARGV:
--   1   payloads       'stored' | 'given'  'stored': each entry's own payload; 'given': ARGV 3.. are pairs
--                      (entry id, payload), each entry replayed with the payload after it (a dead letter's
--                      Celery expires renewed by the CLI). An integer 1..315360000000 reads as 'stored' (the
--                      visibility_ms of versions up to 7, unused since 6)
--   2   count          integer 1..10000  most entries replayed, oldest first (ignored when entry ids are given)
--   3.. entry_id       stream id         replay exactly these entries (unknown ids are skipped); with
--                      'given', each followed by its payload (non-empty)
-- returns: array of the new message ids, in replay order
-- errors:
--   ERR celery-redis-lua: dead_replay: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: dead_replay: expected at least 2 arguments, got N
--   ERR celery-redis-lua: dead_replay: payloads must be 'stored' or 'given', got 'V'
--   ERR celery-redis-lua: dead_replay: 'given' takes pairs of entry id and payload, got N arguments after count
--   ERR celery-redis-lua: dead_replay: the payload given for entry 'V' is empty
--   ERR celery-redis-lua: dead_replay: count must be an integer in 1..10000, got 'V'
--   ERR celery-redis-lua: dead_replay: entry id 'V' is not a stream id
-- why: a replayed message gets a new id (ids are never reused, and ordering by id must stay
--   publish order), a fresh delivery count and no TTL, as if it had just been published
--   without one: an operator who replays an expired message wants it to run. Being ready
--   and without TTL, it needs no index entry; the wake token tells a blocked consumer.
--   An entry replayed with a given payload is checked to exist in this very call, so one that
--   another replay took meanwhile is skipped, never replayed twice. The old visibility_ms slot
--   (an integer) still means 'stored', so an older caller keeps working.
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

-- A consumer with nothing to do blocks on the wake list (BLPOP); a token there wakes one,
-- which runs consume. Pushed only into an empty list: one LLEN while a token already waits.
local function arm_wake(wake_key)
  if redis.call('LLEN', wake_key) > 0 then return false end
  redis.call('RPUSH', wake_key, '1')
  return true
end
local PRIORITY_FACTOR = 10000000000000 -- 10^13 ms per priority level (317 years)

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: dead_replay: ' .. message)
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

-- The state string parse_state reads back, for message `s` in `state` after `count` deliveries.
local function state_line(state, count, s)
  local line = state .. string.format(' %d %d ', count, s.priority) .. s.expires_at -- '%d': no float printing
  if (s.dedup or '') ~= '' then line = line .. ':' .. s.dedup end
  if s.task == '' then return line end
  return line .. ' ' .. s.task
end

-- The Celery task id of a payload (headers.id of a protocol 2 envelope), so a replayed
-- message is in the task-id index again; nil for anything else.
local function task_of(payload)
  local ok, decoded = pcall(cjson.decode, payload)
  local headers = ok and type(decoded) == 'table' and decoded.headers
  local task = type(headers) == 'table' and headers.id
  if type(task) == 'string' and task ~= '' and #task <= 256 then return task end
  return nil
end

if #KEYS ~= 8 then
  return fail('expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got ' .. #KEYS)
end
if #ARGV < 2 then return fail('expected at least 2 arguments, got ' .. #ARGV) end
local queue_key, meta_key, dead_key, message_key, state_key, wake_key = KEYS[1], KEYS[4], KEYS[5], KEYS[6],
  KEYS[7], KEYS[8]
local mode = ARGV[1]
if string.match(mode, '^%d+$') and tonumber(mode) >= 1 and tonumber(mode) <= MAX_DURATION_MS then
  mode = 'stored' -- an older caller's visibility_ms
end
if mode ~= 'stored' and mode ~= 'given' then
  return fail("payloads must be 'stored' or 'given', got '" .. ARGV[1] .. "'")
end
local count = string.match(ARGV[2], '^%d+$') and tonumber(ARGV[2])
if not count or count < 1 or count > 10000 then
  return fail("count must be an integer in 1..10000, got '" .. ARGV[2] .. "'")
end
local step = mode == 'given' and 2 or 1 -- ARGV 3..: entry ids, or (entry id, payload) pairs
if step == 2 and (#ARGV - 2) % 2 ~= 0 then
  return fail("'given' takes pairs of entry id and payload, got " .. (#ARGV - 2) .. ' arguments after count')
end
for i = 3, #ARGV, step do
  if not string.match(ARGV[i], '^%d+%-%d+$') then return fail("entry id '" .. ARGV[i] .. "' is not a stream id") end
  if step == 2 and ARGV[i + 1] == '' then return fail("the payload given for entry '" .. ARGV[i] .. "' is empty") end
end

local entries, given, seen = {}, {}, {}
if #ARGV > 2 or step == 2 then
  for i = 3, #ARGV, step do
    local found = rcall('XRANGE', dead_key, ARGV[i], ARGV[i])[1]
    if found and not seen[found[1]] then -- an entry named twice (or as 05-1 and 5-1) is replayed once
      seen[found[1]] = true
      entries[#entries + 1] = found
      if step == 2 then given[found[1]] = ARGV[i + 1] end
    end
  end
else
  entries = rcall('XRANGE', dead_key, '-', '+', 'COUNT', count)
end

local time = rcall('TIME')
local seconds, micros = tonumber(time[1]), tonumber(time[2])
local now_us = seconds * 1000000 + micros
local now = (now_us - micros % 1000) / 1000
local ids_and_clock = rcall('HMGET', meta_key, 'last_id', 'fair')
local last_id = ids_and_clock[1] or nil -- replayed ids follow it, as published ones do
local ready_at = tonumber(ids_and_clock[2]) or now -- a fair queue: its virtual clock V

local replayed = {}
for _, entry in ipairs(entries) do
  local fields = {}
  for i = 1, #entry[2], 2 do fields[entry[2][i]] = entry[2][i + 1] end
  fields.payload = given[entry[1]] or fields.payload
  if fields.payload then
    local priority = tonumber(fields.priority) or 0
    if priority < 0 or priority > 255 then priority = 0 end
    local id = next_id(last_id, now_us)
    last_id = id
    rcall('HSET', message_key, id, fields.payload)
    local task = task_of(fields.payload)
    local line = state_line('ready', 0, {priority = string.format('%d', priority), expires_at = '-', task = task or ''})
    if task then
      rcall('HSET', state_key, id, line, 'task:' .. task, id)
    else
      rcall('HSET', state_key, id, line)
    end
    rcall('ZADD', queue_key, string.format('%d', (255 - priority) * PRIORITY_FACTOR + ready_at), id)
    replayed[#replayed + 1] = id
  end
  rcall('XDEL', dead_key, entry[1])
end
if #replayed > 0 then
  rcall('HSET', meta_key, 'last_id', last_id)
  if rcall('HEXISTS', meta_key, 'paused') == 0 then arm_wake(wake_key) end -- a paused queue wakes nobody
end
if rcall('XLEN', dead_key) == 0 then rcall('DEL', dead_key) end -- streams outlive their last entry

local expires = stored_ms(rcall('HGET', meta_key, 'expires'))
if expires then
  local at = string.format('%d', now + expires) -- one absolute time: the keys expire together
  for i = 1, 8 do rcall('PEXPIREAT', KEYS[i], at) end
end
return replayed
