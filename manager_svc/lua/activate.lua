-- The run that is active, making the next queued one active if none is (see RunStore.active;
-- start_run.lua then marks it running in its own slot, or it is cleared and this runs again).
-- KEYS: active, queue. Returns the active run id, or false when none is or can be.
local cur = redis.call('GET', KEYS[1])
if cur then return cur end
local nxt = redis.call('LPOP', KEYS[2])
if not nxt then return false end
redis.call('SET', KEYS[1], nxt)
return nxt
