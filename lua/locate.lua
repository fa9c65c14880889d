#!lua flags=no-writes
-- name: locate
-- version: 5
-- summary: Where a task's message is in one queue: ready (and how many are ahead), delayed (ETA), waiting to retry (until when), in flight (deadline), or not here.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages, score = ETA in unix ms
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            queue arguments (not read)
--   dead     STREAM  P dead:{Q}            dead letters (not read; the CLI searches them)
--   message  HASH    P message:{Q}         id -> payload (not read)
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[:DEDUP][ TASK_ID]'; 'task:<task id>' -> id
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (not read)
-- ARGV:
--   1  task_id  string, non-empty, at most 256 bytes   the Celery task id the producer passed to publish
-- returns: array {where, id, delivery_count, priority, expires_at, detail}: where is 'ready'
--   (detail: messages ahead of it, of any priority), 'delayed' (detail: ETA, unix ms), 'retry'
--   (a delayed retry after a failed or returned delivery; detail: unix ms it is ready again) or
--   'in_flight' (detail: unix ms at which the sweep takes it back unless acked or extended);
--   {'missing'} when the queue has no message of that task id (acked, dropped, expired, never
--   published here, or published without its task id)
-- errors:
--   ERR celery-redis-lua: locate: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
--   ERR celery-redis-lua: locate: task_id must be a non-empty string of at most 256 bytes
-- why: the index is kept by the scripts that publish and drop (publish writes it; ack,
--   reject, sweep, consume, purge and cancel remove a message's entries with it), in
--   the queue's own state hash, so it lives in the queue's slot and goes with the queue.
--   The position is its ZRANK: O(log N), an estimate while others publish.

local rcall = redis.call

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

if #KEYS ~= 8 then
  return redis.error_reply('ERR celery-redis-lua: locate: expected 8 keys (queue, delayed, index, meta, dead, ' ..
                           'message, state, wake), got ' .. #KEYS)
end
local task_id = ARGV[1] or ''
if #ARGV ~= 1 or task_id == '' or #task_id > 256 then
  return redis.error_reply('ERR celery-redis-lua: locate: task_id must be a non-empty string of at most 256 bytes')
end

local id = rcall('HGET', KEYS[7], 'task:' .. task_id)
local raw = id and rcall('HGET', KEYS[7], id)
if not raw then return {'missing'} end
local s = parse_state(raw)
local detail
if s.state == 'ready' then
  detail = rcall('ZRANK', KEYS[1], id) or 0 -- ready scores sort by priority, then time, then id
elseif s.state == 'delayed' or s.state == 'retry' then
  detail = tonumber(rcall('ZSCORE', KEYS[2], id) or -1)
else
  detail = tonumber(rcall('ZSCORE', KEYS[3], id) or -1)
end
local where = s.state == 'unacked' and 'in_flight' or s.state
return {where, id, s.count, s.priority, s.expires_at, detail}
