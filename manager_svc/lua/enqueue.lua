-- Queue a new run unless the queue is full (see RunStore.create). One script: a length check
-- in Python before a separate write let concurrent POSTs each see room for one more.
-- KEYS: run hash, runs index, queue | ARGV: max queued, run id, created_at, field, value, ...
if redis.call('LLEN', KEYS[3]) >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 4))
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[2])
redis.call('RPUSH', KEYS[3], ARGV[2])
return 1
