-- Binds an instance id to the process logging in under it (auth callout): claims the id if
-- free, or keeps it if this process holds it already (a reconnect). A new id counts against
-- its credential's cap of live ids (ids whose binding ended leave the count when it is full).
-- Heartbeats renew the binding (beat.lua).
-- KEYS: identity, ids of the credential (set) | ARGV: binding ("<kind>:<public nkey>"),
-- ttl_ms, cap, instance id, identity key prefix (Keys.identity(""), same slot)
-- Returns 1 if the process holds the id now, 0 if another does, -1 if the cap is reached.
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
if not cur and redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[3]) then
  for _, id in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    if redis.call('EXISTS', ARGV[5] .. id) == 0 then redis.call('SREM', KEYS[2], id) end
  end
  if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[3]) then return -1 end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[4])
return 1
