-- Dynamic sampling: the step trains on exactly the groups kept (Ledger.close_step). In one
-- script, every other response leaves the step's sets for its dropped set: complete ones stay
-- complete (their tokens are counted as filtered, for all-equal groups, or discarded), those
-- in flight are aborted (a new epoch fences their owners' later chunks, which commit.lua then
-- counts as discarded too) and the hold that kept the step's remaining count above zero goes,
-- so the barrier follows. A retry after it applied changes nothing.
-- KEYS: step, pending, leased, done, dropped | ARGV: capped (0/1), kept prompt indices (CSV),
-- filtered prompt indices (CSV)
-- Returns {1, tokens discarded, "owner|rid", ...} (the aborted responses that had an owner,
-- to be told), {0}
-- if already closed, {-1} for a step that is not dynamic, {-2, p} if kept group p is not complete.
-- include: common.lua
local st = redis.call('HMGET', KEYS[1], 'created', 'dynamic', 'closed', 'prompts')
if st[1] ~= '1' or st[2] ~= '1' then return {-1} end
after_retirement(run_key_of(KEYS[1]))
if st[3] == '1' then return {0} end
local keep, filtered, kept = {}, {}, 0
for p in string.gmatch(ARGV[2], '%d+') do
  if redis.call('HGET', KEYS[1], 'g:' .. p) ~= '0' then return {-2, p} end
  keep[p] = true
  kept = kept + 1
end
for p in string.gmatch(ARGV[3], '%d+') do filtered[p] = true end
local discarded, filtered_tokens, aborted, told = 0, 0, 0, {1, 0}
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[4])) do
  local req = req_key(rid)
  local f = redis.call('HMGET', req, 'p', 'n')
  if not keep[f[1]] then
    redis.call('SMOVE', KEYS[4], KEYS[5], rid)
    if filtered[f[1]] then filtered_tokens = filtered_tokens + tonumber(f[2])
    else discarded = discarded + tonumber(f[2]) end
  end
end
local function abort(rid, from)
  local req = req_key(rid)
  local f = redis.call('HMGET', req, 'n', 'seen', 'owner')
  discarded = discarded + tonumber(f[1]) + tonumber(f[2] or '0')
  redis.call('HINCRBY', req, 'epoch', 1)
  redis.call('DEL', lease_key(rid))
  release_owner(req, rid)
  redis.call('HSET', req, 'done', 'aborted', 'seen', 0)
  redis.call('SMOVE', from, KEYS[5], rid)
  aborted = aborted + 1
  if f[3] and f[3] ~= '' then told[#told + 1] = f[3] .. '|' .. rid end
end
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[3])) do abort(rid, KEYS[3]) end
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[2])) do abort(rid, KEYS[2]) end
local nfiltered = 0
for _ in pairs(filtered) do nfiltered = nfiltered + 1 end
redis.call('HINCRBY', KEYS[1], 'tokens_discarded', discarded)
redis.call('HSET', KEYS[1], 'closed', 1, 'remaining', 0, 'total',
           redis.call('SCARD', KEYS[4]), 'tokens_filtered', filtered_tokens,
           'groups_kept', kept, 'groups_filtered', nfiltered,
           'groups_discarded', tonumber(st[4]) - kept - nfiltered,
           'responses_aborted', aborted, 'dynamic_sampling_capped', ARGV[1])
told[2] = discarded
wrote(KEYS[1])
wrote(KEYS[5])
expire_late()
return told
