#!lua
-- name: claim
-- version: 2
-- summary: Index and fetch messages that a blocking BZMPOP/ZMPOP already popped from one queue.
-- KEYS: 2
--   queue    ZSET    P queue:{Q}           the queue BZMPOP popped from
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
-- ARGV:
--   1   visibility_ms       integer > 0   visibility deadline of each claimed message, from now
--   2   no_ack              0 or 1        1: delete each message as it is delivered
--   3   message_key_prefix  string        P message: ; the hash is prefix .. '{Q}:' .. id
--   4.. id                  string        the members BZMPOP returned, in order (at most 1000)
-- returns: array {-1, then 4 items per delivered message: 1, id, delivery_count, payload}
--   (the same shape as consume's reply, for one queue; the wake marker, expired
--   messages and messages another consumer holds are skipped)
-- errors:
--   ERR celery-redis-lua: claim: expected 2 keys (queue, index), got N
--   ERR celery-redis-lua: claim: expected at least 4 arguments, got N
--   ERR celery-redis-lua: claim: at most 1000 ids per call, got N
--   ERR celery-redis-lua: claim: key 'K' has no {hash tag}
--   ERR celery-redis-lua: claim: visibility_ms must be a positive integer, got 'V'
--   ERR celery-redis-lua: claim: no_ack must be 0 or 1, got 'V'
-- why: publish indexed the message already, so a consumer that dies between BZMPOP and
--   claim loses nothing: the sweep finds the index entry and puts the message back.
--   If that happened while this consumer was merely slow, the restored copy is removed
--   from the queue again here so that it is not delivered twice; and if another consumer
--   already took that copy (state 'unacked'), this claim skips it, so two consumers never
--   hold the same delivery (its delivery_count is the fence reject relies on).

local rcall = redis.call
local WAKE_MEMBER = '~wake'

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: claim: ' .. message)
end

if #KEYS ~= 2 then return fail('expected 2 keys (queue, index), got ' .. #KEYS) end
if #ARGV < 4 then return fail('expected at least 4 arguments, got ' .. #ARGV) end
if #ARGV > 1003 then return fail('at most 1000 ids per call, got ' .. (#ARGV - 3)) end
local queue_key, index_key = KEYS[1], KEYS[2]
local brace = string.find(queue_key, '{', 1, true)
if not brace then return fail("key '" .. queue_key .. "' has no {hash tag}") end
local visibility = string.match(ARGV[1], '^%d+$') and tonumber(ARGV[1])
if not visibility or visibility <= 0 then
  return fail("visibility_ms must be a positive integer, got '" .. ARGV[1] .. "'")
end
if ARGV[2] ~= '0' and ARGV[2] ~= '1' then return fail("no_ack must be 0 or 1, got '" .. ARGV[2] .. "'") end
local no_ack = ARGV[2] == '1'
local message_prefix = ARGV[3] .. string.sub(queue_key, brace) .. ':'

local time = rcall('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local deadline = string.format('%d', now + visibility)

local ids = {}
for i = 4, #ARGV do
  if ARGV[i] ~= WAKE_MEMBER then ids[#ids + 1] = ARGV[i] end
end
if #ids == 0 then return {-1} end
rcall('ZREM', queue_key, unpack(ids)) -- a sweep may have restored them while we were on our way

local reply, deadlines, gone = {-1}, {}, {}
for _, id in ipairs(ids) do
  local message_key = message_prefix .. id
  local message = rcall('HMGET', message_key, 'payload', 'delivery_count', 'state')
  -- 'unacked': restored while we were on our way and delivered to another consumer: theirs
  if not message[1] then
    gone[#gone + 1] = id -- expired (message TTL)
  elseif message[3] ~= 'unacked' then
    if no_ack then
      rcall('DEL', message_key)
      gone[#gone + 1] = id
    else
      rcall('HSET', message_key, 'state', 'unacked')
      deadlines[#deadlines + 1] = deadline
      deadlines[#deadlines + 1] = id
    end
    reply[#reply + 1] = 1
    reply[#reply + 1] = id
    reply[#reply + 1] = tonumber(message[2]) or 0
    reply[#reply + 1] = message[1]
  end
end
if #gone > 0 then rcall('ZREM', index_key, unpack(gone)) end
if #deadlines > 0 then rcall('ZADD', index_key, unpack(deadlines)) end
return reply
