-- The running run, activating the next queued one if none is running (see RunStore.active).
-- KEYS: active, queue | ARGV: run key prefix, now
local cur = redis.call('GET', KEYS[1])
if cur then
  if redis.call('HGET', ARGV[1] .. cur, 'state') == 'running' then return cur end
  redis.call('DEL', KEYS[1])
end
while true do
  local nxt = redis.call('LPOP', KEYS[2])
  if not nxt then return false end
  if redis.call('HGET', ARGV[1] .. nxt, 'state') == 'queued' then
    redis.call('SET', KEYS[1], nxt)
    redis.call('HSET', ARGV[1] .. nxt, 'state', 'running', 'updated_at', ARGV[2])
    return nxt
  end
end
