#!lua flags=allow-oom
-- name: ack
-- version: 1
-- summary: Acknowledge messages of one queue: delete them and every trace of them.
-- KEYS: 2
--   queue    ZSET    P queue:{Q}           ready messages (a restored copy of an acked message is removed too)
--   index    ZSET    P messages_index:{Q}  id -> unix ms at which the sweep looks at it again
-- ARGV:
--   1   message_key_prefix  string   P message: ; the hash is prefix .. '{Q}:' .. id
--   2.. id                  string   message ids to acknowledge
-- returns: integer, how many of the messages still existed
-- errors:
--   ERR celery-redis-lua: ack: expected 2 keys (queue, index), got N
--   ERR celery-redis-lua: ack: expected a message key prefix and at least one id
--   ERR celery-redis-lua: ack: key 'K' has no {hash tag}
-- why: allow-oom, because acking frees memory and must work on a full server. Acking a
--   message that the sweep already put back (visibility timeout passed) cancels the
--   restored copy, so a slow but successful task does not run again.

local rcall = redis.call

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: ack: ' .. message)
end

if #KEYS ~= 2 then return fail('expected 2 keys (queue, index), got ' .. #KEYS) end
if #ARGV < 2 then return fail('expected a message key prefix and at least one id') end
local queue_key, index_key = KEYS[1], KEYS[2]
local brace = string.find(queue_key, '{', 1, true)
if not brace then return fail("key '" .. queue_key .. "' has no {hash tag}") end
local message_prefix = ARGV[1] .. string.sub(queue_key, brace) .. ':'

-- One command over many arguments, in chunks that Lua's unpack() can take.
local function variadic(command, key_or_nil, items)
  local total = 0
  for first = 1, #items, 4000 do
    local last = math.min(first + 3999, #items)
    if key_or_nil then
      total = total + rcall(command, key_or_nil, unpack(items, first, last))
    else
      total = total + rcall(command, unpack(items, first, last))
    end
  end
  return total
end

local ids, message_keys = {}, {}
for i = 2, #ARGV do
  ids[#ids + 1] = ARGV[i]
  message_keys[#message_keys + 1] = message_prefix .. ARGV[i]
end
variadic('ZREM', index_key, ids)
variadic('ZREM', queue_key, ids)
return variadic('DEL', nil, message_keys)
