-- Registers one heartbeat; returns the request ids the instance holds, or nil if it left.
-- Registration and departure are ordered by Redis: a beat that a process sent just before it
-- released its work either lands first (and is then forgotten by the release) or finds the
-- departure mark and is refused, so a leaver never reappears as alive.
-- KEYS: instance, instances, instance's held set, departed, identity (auth callout) | ARGV: fields (JSON list of
-- alternating names and values), ttl_ms, session, instance id, now
local departed = redis.call('GET', KEYS[4])
if ARGV[3] ~= '' and departed == ARGV[3] then return false end
if redis.call('HGET', KEYS[1], 'session') ~= ARGV[3] then
  redis.call('HSET', KEYS[1], 'joined_at', ARGV[5])  -- a new process under this id
end
redis.call('HSET', KEYS[1], unpack(cjson.decode(ARGV[1])))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[5], ARGV[2])  -- the id stays bound to its key while it beats
redis.call('SADD', KEYS[2], ARGV[4])
return redis.call('SMEMBERS', KEYS[3])
