-- Takes a response back from its owner: a new epoch fences the old owner's later chunks.
-- KEYS: req, lease, pending, leased, step | ARGV: rid, expected_epoch ('' = any),
-- mode ('token': the next owner resumes after the committed tokens; 'request': it starts over),
-- holder ('' = the manager's own decision; else the instance handing it back, which must hold it)
-- Returns 1 revoked, 0 nothing to do (done, another epoch, not leased), -1 the holder named is not
-- the owner: an instance may hand back only what it holds.
-- include: common.lua
local req = KEYS[1]
after_retirement(run_key(run_of(ARGV[1])))  -- a late hand-back, after its run was retired
if redis.call('HGET', req, 'done') == '1' then return 0 end
local cur = redis.call('HGET', req, 'epoch')
if ARGV[2] ~= '' and cur ~= ARGV[2] then return 0 end
if ARGV[4] ~= '' and redis.call('HGET', req, 'owner') ~= ARGV[4] then return -1 end
if redis.call('SISMEMBER', KEYS[4], ARGV[1]) == 0 then return 0 end
redis.call('HINCRBY', req, 'epoch', 1)
redis.call('DEL', KEYS[2])
release_owner(req, ARGV[1])
redis.call('SMOVE', KEYS[4], KEYS[3], ARGV[1])
-- Waste: tokens the owner last reported generated but not yet published are lost (chunks it
-- published but that arrive after this are counted when they are rejected as stale); in
-- request mode the committed tokens are thrown away too.
local n = tonumber(redis.call('HGET', req, 'n'))
local waste = tonumber(redis.call('HGET', req, 'seen') or '0')
if ARGV[3] == 'request' and n > 0 then
  waste = waste + n
  redis.call('HDEL', req, 'tokens')  -- a legacy response's, if it was never moved
  redis.call('DEL', req .. TOKENS, req .. LOGPROBS)
  redis.call('HDEL', req, 'versions', 'vlast')  -- an asynchronous run's: from the start again
  redis.call('HSET', req, 'n', 0, 'instances', '', 'last', '')
  redis.call('HINCRBY', KEYS[5], 'tokens', -n)
end
redis.call('HSET', req, 'seen', 0)
redis.call('HINCRBY', KEYS[5], 'tokens_regenerated', waste)
wrote(KEYS[3])
wrote(KEYS[5])
expire_late()
return 1
