-- Queue a run whose record is written unless the queue is full (see RunStore.create). One
-- script: a length check in Python before a separate write let concurrent POSTs each see room
-- for one more. KEYS: runs index, queue | ARGV: max queued, run id, created_at
if redis.call('LLEN', KEYS[2]) >= tonumber(ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[2])
redis.call('RPUSH', KEYS[2], ARGV[2])
return 1
