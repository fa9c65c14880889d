#!lua flags=allow-oom
-- name: delete
-- version: 6
-- summary: Delete a queue: every message (ready, delayed, in flight), its arguments and its dead letters; name the fanout exchanges it was bound to.
-- KEYS: 8
--   queue    ZSET    P queue:{Q}           ready messages
--   delayed  ZSET    P delayed:{Q}         delayed messages
--   index    ZSET    P messages_index:{Q}  in-flight messages, and ready ones with a TTL
--   meta     HASH    P meta:{Q}            queue arguments, last_id, and 'fanout:<exchange>' per fanout binding (read first)
--   dead     STREAM  P dead:{Q}            dead letters
--   message  HASH    P message:{Q}         id -> payload
--   state    HASH    P state:{Q}           id -> 'STATE DELIVERY_COUNT PRIORITY EXPIRES_AT[ TASK_ID]', and the task-id index
--   wake     LIST    P wake:{Q}            wake token of blocked consumers (deleted with the rest)
-- ARGV: none
-- returns: array {held, exchange...}: how many messages the queue held, then the fanout exchanges
--   it was bound to (recorded by declare), whose consumer groups the caller removes with fanout_unbind
-- errors:
--   ERR celery-redis-lua: delete: expected 8 keys (queue, delayed, index, meta, dead, message, state, wake), got N
-- why: a queue's messages live in its own two hashes, so deleting it is eight UNLINKs:
--   the server frees large keys in a background thread, and a queue of a million
--   messages goes without blocking it. Ids never restart (they follow the server's
--   clock), so a late ack from before the deletion cannot touch a message published to a
--   queue declared again under the same name. A fanout binding is a consumer group on the
--   exchange's stream, in another cluster slot, so this script cannot remove it: it names
--   the exchanges instead, from the queue's own record, and whoever deletes the queue
--   (any connection, not only the one that bound it) then runs fanout_unbind on each; that
--   second call is idempotent. allow-oom: it frees memory.

local rcall = redis.call

if #KEYS ~= 8 then
  return redis.error_reply('ERR celery-redis-lua: delete: expected 8 keys (queue, delayed, index, meta, dead, ' ..
                           'message, state, wake), got ' .. #KEYS)
end
local reply = {rcall('HLEN', KEYS[6])} -- payloads only (the state hash also holds the task-id index)
local fields = rcall('HGETALL', KEYS[4]) -- a handful of arguments and counters
for i = 1, #fields, 2 do
  if string.sub(fields[i], 1, 7) == 'fanout:' then reply[#reply + 1] = string.sub(fields[i], 8) end
end
for i = 1, 8 do rcall('UNLINK', KEYS[i]) end
return reply
