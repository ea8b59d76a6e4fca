-- The dispatch lease of manager replicas: take it if free, keep it if this replica holds it,
-- or (ttl 0) give it up if it still does. Returns 1 if ARGV[1] holds the lease afterwards.
-- KEYS: lease | ARGV: holder, ttl_ms
local cur = redis.call('GET', KEYS[1])
if ARGV[2] == '0' then
  if cur == ARGV[1] then redis.call('DEL', KEYS[1]) end
  return 0
end
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
