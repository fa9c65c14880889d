#!lua
-- name: dead_replay
-- version: 1
-- summary: Move dead letters of one queue back into it as fresh ready messages (delivery count 0).
-- KEYS: 4
--   dead     STREAM  P dead:{Q}            dead letters: id, reason, delivery_count, priority, payload
--   queue    ZSET    P queue:{Q}           ready messages
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
--   meta     HASH    P meta:{Q}            the id sequence
-- ARGV:
--   1   message_key_prefix  string            P message: ; the hash is prefix .. '{Q}:' .. id
--   2   visibility_ms       integer > 0       how long a replayed message may sit popped but unclaimed
--   3   count               integer 1..10000  most entries replayed, oldest first (ignored when entry ids are given)
--   4.. entry_id            stream id         replay exactly these entries (unknown ids are skipped)
-- returns: array of the new message ids, in replay order
-- errors:
--   ERR celery-redis-lua: dead_replay: expected 4 keys (dead, queue, index, meta), got N
--   ERR celery-redis-lua: dead_replay: expected at least 3 arguments, got N
--   ERR celery-redis-lua: dead_replay: key 'K' has no {hash tag}
--   ERR celery-redis-lua: dead_replay: visibility_ms must be a positive integer, got 'V'
--   ERR celery-redis-lua: dead_replay: count must be an integer in 1..10000, got 'V'
--   ERR celery-redis-lua: dead_replay: entry id 'V' is not a stream id
-- why: a replayed message gets a new id from the queue's sequence (its old id may be
--   reused by nothing, but ordering by id must stay publish order) and a fresh delivery
--   count, as if it had just been published.

local rcall = redis.call
local PRIORITY_FACTOR = 10000000000000

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: dead_replay: ' .. message)
end

if #KEYS ~= 4 then return fail('expected 4 keys (dead, queue, index, meta), got ' .. #KEYS) end
if #ARGV < 3 then return fail('expected at least 3 arguments, got ' .. #ARGV) end
local dead_key, queue_key, index_key, meta_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local brace = string.find(queue_key, '{', 1, true)
if not brace then return fail("key '" .. queue_key .. "' has no {hash tag}") end
local visibility = string.match(ARGV[2], '^%d+$') and tonumber(ARGV[2])
if not visibility or visibility == 0 then
  return fail("visibility_ms must be a positive integer, got '" .. ARGV[2] .. "'")
end
local count = string.match(ARGV[3], '^%d+$') and tonumber(ARGV[3])
if not count or count < 1 or count > 10000 then
  return fail("count must be an integer in 1..10000, got '" .. ARGV[3] .. "'")
end
for i = 4, #ARGV do
  if not string.match(ARGV[i], '^%d+%-%d+$') then return fail("entry id '" .. ARGV[i] .. "' is not a stream id") end
end
local message_prefix = ARGV[1] .. string.sub(queue_key, brace) .. ':'

local entries = {}
if #ARGV > 3 then
  for i = 4, #ARGV do
    local found = rcall('XRANGE', dead_key, ARGV[i], ARGV[i])
    if found[1] then entries[#entries + 1] = found[1] end
  end
else
  entries = rcall('XRANGE', dead_key, '-', '+', 'COUNT', count)
end

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local replayed = {}
for _, entry in ipairs(entries) do
  local fields = {}
  for i = 1, #entry[2], 2 do fields[entry[2][i]] = entry[2][i + 1] end
  if fields.payload then
    local priority = tonumber(fields.priority) or 0
    local id = string.format('%016x', rcall('HINCRBY', meta_key, 'seq', 1))
    rcall('HSET', message_prefix .. id, 'payload', fields.payload, 'priority', priority,
          'delivery_count', 0, 'state', 'ready')
    rcall('ZADD', queue_key, string.format('%d', (255 - priority) * PRIORITY_FACTOR + now), id)
    rcall('ZADD', index_key, string.format('%d', now + visibility), id)
    replayed[#replayed + 1] = id
  end
  rcall('XDEL', dead_key, entry[1])
end
if rcall('XLEN', dead_key) == 0 then rcall('DEL', dead_key) end -- streams outlive their last entry
return replayed
