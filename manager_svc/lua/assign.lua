-- Leases pending responses of one step to one instance, each under a new epoch (the fencing
-- token), all in one call: thousands of responses a step cost one round trip per instance,
-- not two per response. A response that is done or no longer pending (another pass took it)
-- is skipped: false in its place.
-- KEYS: pending, leased, step, the instance's held set of the run, the run's holders
-- ARGV: instance, ttl_ms, now, the instance's weight version ('' in a synchronous run: the
-- step's own), then the request ids (all of the step).
-- Returns per id {epoch, tokens, prompt, version, max}. With a version (an asynchronous run,
-- docs/async.md) the lease is of that version: the commit script then accepts entries of it
-- alone, and where it differs from the version of the response's last lease the response's
-- `versions` gains "<first token>:<version>", so a sample says which version made each token.
-- include: common.lua
local inst, ttl, now, held, leased_version = ARGV[1], ARGV[2], ARGV[3], KEYS[4], ARGV[4]
after_retirement(run_key_of(KEYS[5]))  -- a dispatch pass that read the run before it ended
local out, migrations = {}, 0
for i = 5, #ARGV do
  local rid = ARGV[i]
  local req = req_key(rid)
  -- One read of what the lease needs, before anything is written: seven commands a response
  -- where there were ten, and no read of its tokens while it has none (a fresh step's all).
  local st = redis.call('HMGET', req, 'done', 'n', 'last', 'tokens', 'prompt', 'version', 'max')
  if st[1] ~= '1' and redis.call('SISMEMBER', KEYS[1], rid) == 1 then
    local epoch = redis.call('HINCRBY', req, 'epoch', 1)
    redis.call('SET', lease_key(rid), inst .. ':' .. epoch, 'PX', ttl)
    redis.call('SMOVE', KEYS[1], KEYS[2], rid)
    redis.call('SADD', held, rid)
    -- Committed tokens made by another instance: this lease moves the response.
    local n = tonumber(st[2])
    if n > 0 and st[3] ~= inst then migrations = migrations + 1 end
    -- A fresh lease counts as progress: the no-progress check (stalled_leases.lua) measures from
    -- here until its first commit.
    redis.call('HSET', req, 'owner', inst, 'assigned_at', now, 'progress_at', now)
    take_legacy_tokens(req, st[4])
    local tokens = ''
    if n > 0 then tokens = redis.call('GET', req .. TOKENS) or '' end
    local version = st[6]
    if leased_version ~= '' then
      version = leased_version
      if redis.call('HGET', req, 'vlast') ~= version then
        csv_append(req, 'versions', n .. ':' .. version)
        redis.call('HSET', req, 'vlast', version)
      end
      redis.call('HSET', req, 'version', version)
    end
    out[#out + 1] = {epoch, tokens, st[5], version, st[7]}
  else
    out[#out + 1] = false
  end
end
if migrations > 0 then redis.call('HINCRBY', KEYS[3], 'migrations', migrations) end
-- Whose held sets the run has: retiring the run expires them with its other keys.
redis.call('SADD', KEYS[5], inst)
for _, key in ipairs({KEYS[2], KEYS[3], held, KEYS[5]}) do wrote(key) end
expire_late()
return out
