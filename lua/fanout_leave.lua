#!lua flags=allow-oom
-- name: fanout_leave
-- version: 1
-- summary: Remove one consumer from a bound queue's consumer group (its channel closed).
-- KEYS: 1
--   stream   STREAM  P /<db>.<exchange>   fanout messages
-- ARGV:
--   1  queue     string, non-empty   the bound queue (the consumer group)
--   2  consumer  string, non-empty   the consumer that leaves
-- returns: integer, 1 if the consumer was removed, else 0
-- errors:
--   ERR celery-redis-lua: fanout_leave: expected 1 key (stream), got N
--   ERR celery-redis-lua: fanout_leave: expected 2 arguments, got N
--   ERR celery-redis-lua: fanout_leave: queue and consumer must be non-empty
-- why: every channel reads as its own consumer; without this each worker restart would
--   leave one behind. Entries are acked as they are read, so a consumer holds nothing and
--   removing it loses nothing. allow-oom, because it only frees memory.

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: fanout_leave: ' .. message)
end

if #KEYS ~= 1 then return fail('expected 1 key (stream), got ' .. #KEYS) end
if #ARGV ~= 2 then return fail('expected 2 arguments, got ' .. #ARGV) end
if ARGV[1] == '' or ARGV[2] == '' then return fail('queue and consumer must be non-empty') end

local consumers = redis.pcall('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if type(consumers) ~= 'table' or consumers.err then return 0 end -- no stream or no group
for _, consumer in ipairs(consumers) do
  for i = 1, #consumer, 2 do
    if consumer[i] == 'name' and consumer[i + 1] == ARGV[2] then
      redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
      return 1
    end
  end
end
return 0
