#!lua flags=allow-oom
-- name: delete
-- version: 5
-- summary: Delete a queue: every message (ready, delayed, in flight), its arguments and its dead letters.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  in-flight messages, and ready ones with a TTL
--   meta     HASH    P meta:{Q}            queue arguments and last_id
--   dead     STREAM  P dead:{Q}            dead letters
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]', and the task-id index
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (deleted with the rest)
-- ARGV: none
-- returns: integer, how many messages the queue held
-- errors:
--   ERR celery-redis-lua: delete: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
-- why: a queue's messages live in its own two hashes, so deleting it is eight UNLINKs:
--   the server frees large keys in a background thread, and a queue of a million
--   messages goes without blocking it. Ids never restart (they follow the server's
--   clock), so a late ack from before the deletion cannot touch a message published to a
--   queue declared again under the same name. allow-oom: it frees memory.

local rcall = redis.call

if #KEYS ~= 8 then
  return redis.error_reply('ERR celery-redis-lua: delete: expected 8 keys (queue, delayed, index, meta, dead, ' ..
                           'message, state, wake), got ' .. #KEYS)
end
local held = rcall('HLEN', KEYS[6]) -- payloads only (the state hash also holds the task-id index)
for i = 1, 8 do rcall('UNLINK', KEYS[i]) end
return held
