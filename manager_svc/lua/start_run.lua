-- Marks the active run running (RunStore.active): a queued run starts, a running one stays;
-- any other (cancelled while queued, ended) is refused, and the caller clears it as active.
-- KEYS: the run | ARGV: now. Returns 1 if the run runs.
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'running' then return 1 end
if state ~= 'queued' then return 0 end
redis.call('HSET', KEYS[1], 'state', 'running', 'updated_at', ARGV[1])
return 1
