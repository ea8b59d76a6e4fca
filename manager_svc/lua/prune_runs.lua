-- Take ended runs whose retention is over out of the runs index (see RunStore.prune): the
-- archive lists them from then on. A run whose hash still lives stays listed for now.
-- KEYS: runs index, expiring | ARGV: run key prefix, now (ms), batch
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))
local gone = 0
for _, id in ipairs(ids) do
  if redis.call('EXISTS', ARGV[1] .. id) == 0 then
    redis.call('ZREM', KEYS[1], id)
    redis.call('ZREM', KEYS[2], id)
    gone = gone + 1
  end
end
return gone
