-- Binds an instance id to the public nkey of the process logging in under it (auth callout):
-- claims the id if free, or keeps it if this key holds it already (a reconnect). Returns 1 if
-- the key holds the id now, 0 if another key does. Heartbeats renew the binding (register.lua).
-- KEYS: identity | ARGV: public nkey, ttl_ms
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
