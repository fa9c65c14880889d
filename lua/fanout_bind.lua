#!lua
-- name: fanout_bind
-- version: 1
-- summary: Give a queue bound to a fanout exchange its own consumer group on the exchange's stream.
-- KEYS: 1
--   stream   STREAM  P /<db>.<exchange>   fanout messages; entry fields 'payload', 'routing_key'
-- ARGV:
--   1  queue       string, non-empty    the bound queue; it names the consumer group
--   2  expires_ms  integer > 0 or ''    the stream expires after this long without a publish or bind; '' means never
-- returns: integer, 1 if the group was created now, 0 if it existed
-- errors:
--   ERR celery-redis-lua: fanout_bind: expected 1 key (stream), got N
--   ERR celery-redis-lua: fanout_bind: expected 2 arguments, got N
--   ERR celery-redis-lua: fanout_bind: queue is missing or empty
--   ERR celery-redis-lua: fanout_bind: expires_ms must be a positive integer or empty, got 'V'
-- why: the group starts at the stream's end when the queue is bound, so the queue receives
--   every entry published after it was bound (as with AMQP), even when its consumer starts
--   later, and a restarted consumer resumes where the group left off (within stream_maxlen).

local rcall = redis.call

local function fail(message)
  return redis.error_reply('ERR celery-redis-lua: fanout_bind: ' .. message)
end

if #KEYS ~= 1 then return fail('expected 1 key (stream), got ' .. #KEYS) end
if #ARGV ~= 2 then return fail('expected 2 arguments, got ' .. #ARGV) end
if ARGV[1] == '' then return fail('queue is missing or empty') end
local expires = ARGV[2] ~= '' and string.match(ARGV[2], '^%d+$') and tonumber(ARGV[2])
if ARGV[2] ~= '' and (not expires or expires == 0) then
  return fail("expires_ms must be a positive integer or empty, got '" .. ARGV[2] .. "'")
end

local created = 0
local exists = rcall('EXISTS', KEYS[1]) == 1
local found = false
if exists then
  for _, group in ipairs(rcall('XINFO', 'GROUPS', KEYS[1])) do
    for i = 1, #group, 2 do
      if group[i] == 'name' and group[i + 1] == ARGV[1] then found = true end
    end
  end
end
if not found then
  rcall('XGROUP', 'CREATE', KEYS[1], ARGV[1], '$', 'MKSTREAM')
  created = 1
end
if expires then rcall('PEXPIRE', KEYS[1], expires) end
return created
