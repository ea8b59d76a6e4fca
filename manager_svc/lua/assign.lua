-- Leases a pending response to an instance under a new epoch (the fencing token).
-- KEYS: req, lease, pending, leased, step | ARGV: rid, instance, ttl_ms, now, held_prefix
local req = KEYS[1]
if redis.call('HGET', req, 'done') == '1' then return nil end
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 then return nil end
local epoch = redis.call('HINCRBY', req, 'epoch', 1)
redis.call('SET', KEYS[2], ARGV[2] .. ':' .. epoch, 'PX', ARGV[3])
redis.call('SMOVE', KEYS[3], KEYS[4], ARGV[1])
redis.call('SADD', ARGV[5] .. ARGV[2] .. ':held', ARGV[1])
local st = redis.call('HMGET', req, 'n', 'last', 'tokens', 'prompt')
if tonumber(st[1]) > 0 and st[2] ~= ARGV[2] then redis.call('HINCRBY', KEYS[5], 'migrations', 1) end
redis.call('HSET', req, 'owner', ARGV[2], 'assigned_at', ARGV[4])
return {epoch, st[3] or '', st[4]}
