#!lua
-- name: claim
-- version: 6
-- summary: Index and fetch messages that a blocking BZMPOP/ZMPOP already popped from one queue.
-- KEYS: 7
--   queue    ZSET    P queue:{Q}           the queue BZMPOP popped from
--   delayed  ZSET    P delayed:{Q}         delayed messages (expiry refresh only)
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments; 'expires' (ms) is refreshed on all seven keys; counters 'redelivered', 'dropped:<reason>' (HINCRBY)
--   dead     STREAM  P dead:{Q}            dead letters: id, reason, delivery_count, priority, payload
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]'
-- ARGV:
--   1   visibility_ms       integer > 0    visibility deadline of each claimed message, from now
--   2   no_ack              0 or 1         1: delete each message as it is delivered
--   3   dead_letter_maxlen  integer >= 0   approximate cap of the dead-letter stream; 0 deletes expired messages outright
--   4.. id                  string         the members BZMPOP returned, in order (at most 1000)
-- returns: array {-1, expired, then 4 items per delivered message: 1, id, delivery_count, payload}
--   (the same shape as consume's reply, for one queue; the wake marker, orphans and
--   messages another consumer holds are skipped; expired ones are dead-lettered)
-- errors:
--   ERR celery-redis-lua: claim: expected 7 keys (queue, delayed, index, meta, dead, message, state), got N
--   ERR celery-redis-lua: claim: expected at least 4 arguments, got N
--   ERR celery-redis-lua: claim: at most 1000 ids per call, got N
--   ERR celery-redis-lua: claim: key 'K' has no {hash tag}
--   ERR celery-redis-lua: claim: visibility_ms must be a positive integer, got 'V'
--   ERR celery-redis-lua: claim: no_ack must be 0 or 1, got 'V'
--   ERR celery-redis-lua: claim: dead_letter_maxlen must be an integer >= 0, got 'V'
-- why: publish indexed the message already, so a consumer that dies between BZMPOP and
--   claim loses nothing: the sweep finds the index entry and puts the message back.
--   If that happened while this consumer was merely slow, the restored copy is removed
--   from the queue again here so that it is not delivered twice; and if another consumer
--   already took that copy (state 'unacked'), this claim skips it, so two consumers never
--   hold the same delivery (its delivery_count is the fence reject relies on). Because a
--   second run skips what the first one took, a re-sent claim delivers nothing twice.

local rcall = redis.call

-- The task-id index (publish writes it, where/cancel read it): 'task:<task id>' -> message
-- id, a field of the state hash; the task id is also the last word of the message's state
-- string (parse_state's `task`). A message that goes takes its entry with it; a newer
-- message of the same task id (a retry) keeps its own.
local function forget_task(state_key, id, s)
  if s and s.task ~= '' and redis.call('HGET', state_key, 'task:' .. s.task) == id then
    redis.call('HDEL', state_key, 'task:' .. s.task)
  end
end
local WAKE_MEMBER = '~wake' -- wakes a consumer blocked on BZMPOP when something is delayed

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: claim: ' .. message)
end

-- Counters for dashboards (metrics.lua reads them): redeliveries and drops by reason, in the
-- queue's meta hash, so they expire and go with the queue. Written before its expiry refresh.
local function count_in_meta(meta_key, field, n)
  if n > 0 then redis.call('HINCRBY', meta_key, field, n) end
end

-- 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]'; a malformed value reads as a fresh
-- ready message. The task id goes last because it may hold spaces; '' when there is none.
local function parse_state(value)
  local state, count, priority, expires_at, task = string.match(value, '^(%a+) (%d+) (%d+) (%S+) ?(.*)$')
  if not state then return {state = 'ready', count = 0, priority = 0, expires_at = '-', task = ''} end
  return {state = state, count = tonumber(count), priority = tonumber(priority), expires_at = expires_at,
          task = task}
end

-- The state string parse_state reads back, for message `s` in `state` after `count` deliveries.
local function state_line(state, count, s)
  local line = state .. ' ' .. count .. ' ' .. s.priority .. ' ' .. s.expires_at
  if s.task == '' then return line end
  return line .. ' ' .. s.task
end

if #KEYS ~= 7 then
  return fail('expected 7 keys (queue, delayed, index, meta, dead, message, state), got ' .. #KEYS)
end
if #ARGV < 4 then return fail('expected at least 4 arguments, got ' .. #ARGV) end
if #ARGV > 1003 then return fail('at most 1000 ids per call, got ' .. (#ARGV - 3)) end
local queue_key, index_key, meta_key, dead_key, message_key, state_key = KEYS[1], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6], KEYS[7]
local open = string.find(queue_key, '{', 1, true)
local close = open and string.find(queue_key, '}', open + 1, true)
if not close or close == open + 1 then return fail("key '" .. queue_key .. "' has no {hash tag}") end
local visibility = string.match(ARGV[1], '^%d+$') and tonumber(ARGV[1])
if not visibility or visibility <= 0 then
  return fail("visibility_ms must be a positive integer, got '" .. ARGV[1] .. "'")
end
if ARGV[2] ~= '0' and ARGV[2] ~= '1' then return fail("no_ack must be 0 or 1, got '" .. ARGV[2] .. "'") end
local no_ack = ARGV[2] == '1'
local dead_maxlen = string.match(ARGV[3], '^%d+$') and tonumber(ARGV[3])
if not dead_maxlen then return fail("dead_letter_maxlen must be an integer >= 0, got '" .. ARGV[3] .. "'") end

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local deadline = string.format('%d', now + visibility)

local ids = {}
for i = 4, #ARGV do
  if ARGV[i] ~= WAKE_MEMBER then ids[#ids + 1] = ARGV[i] end
end

local reply, deadlines, gone, expired = {-1, 0}, {}, {}, 0
if #ids > 0 then
  rcall('ZREM', queue_key, unpack(ids)) -- a sweep may have restored them while we were on our way
end
for _, id in ipairs(ids) do
  local payload = rcall('HGET', message_key, id)
  local raw = rcall('HGET', state_key, id)
  local s = raw and parse_state(raw)
  local at = s and tonumber(s.expires_at)
  if not payload or not s or (s.state ~= 'unacked' and at and at <= now) then
    if payload and s and dead_maxlen > 0 then
      rcall('XADD', dead_key, 'MAXLEN', '~', dead_maxlen, '*', 'id', id, 'reason', 'expired',
            'delivery_count', s.count, 'priority', s.priority, 'payload', payload)
    end
    if payload and s then expired = expired + 1 end
    rcall('HDEL', message_key, id)
    forget_task(state_key, id, s)
    rcall('HDEL', state_key, id)
    gone[#gone + 1] = id
  elseif s.state ~= 'unacked' then -- 'unacked': restored meanwhile and delivered to another consumer
    if no_ack then
      rcall('HDEL', message_key, id)
      forget_task(state_key, id, s)
      rcall('HDEL', state_key, id)
      gone[#gone + 1] = id
    else
      rcall('HSET', state_key, id, state_line('unacked', s.count, s))
      deadlines[#deadlines + 1] = deadline
      deadlines[#deadlines + 1] = id
    end
    reply[#reply + 1] = 1
    reply[#reply + 1] = id
    reply[#reply + 1] = s.count
    reply[#reply + 1] = payload
  end
end
reply[2] = expired
if #gone > 0 then rcall('ZREM', index_key, unpack(gone)) end
if #deadlines > 0 then rcall('ZADD', index_key, unpack(deadlines)) end

count_in_meta(meta_key, 'dropped:expired', expired)
local expires = tonumber(rcall('HGET', meta_key, 'expires'))
if expires then
  local at = string.format('%d', now + expires) -- one absolute time: the keys expire together
  for i = 1, 7 do rcall('PEXPIREAT', KEYS[i], at) end
end
return reply
