-- Helpers shared by the ledger's scripts. Redis scripts cannot include one another: the loader
-- (manager_svc/scripts.py) puts this text where a script says `-- include: common.lua`.
-- include: keys.lua
-- include: retired.lua
-- A response's tokens are a string key of their own, appended to (names.Keys.tokens).
local TOKENS = '@TOKENS_SUFFIX@'
-- Its behaviour log-probs, appended with them (names.Keys.logprobs): 8 hex digits a token.
local LOGPROBS = '@LOGPROBS_SUFFIX@'
local function take_legacy_tokens(req, legacy)
  -- A response written before its tokens had a key of their own keeps them in its hash: they
  -- move on its first lease or commit, so an upgraded manager continues it exactly.
  if legacy and legacy ~= '' then
    redis.call('SET', req .. TOKENS, legacy)
    wrote(req .. TOKENS)
    redis.call('HDEL', req, 'tokens')
  end
end
local function csv_append(key, field, value)
  local cur = redis.call('HGET', key, field) or ''
  if cur == '' then redis.call('HSET', key, field, value)
  else redis.call('HSET', key, field, cur .. ',' .. value) end
end
local function release_owner(req, rid)
  local owner = redis.call('HGET', req, 'owner')
  if owner and owner ~= '' then redis.call('SREM', held_key(run_of(rid), owner), rid) end
  redis.call('HSET', req, 'owner', '')
end
local function write_request(rid, run, step, p, s, version, prompt, max_new)
  -- A response as created, fresh (create_requests.lua, extend_step.lua).
  local key = req_key(rid)
  redis.call('DEL', key, key .. TOKENS, key .. LOGPROBS)
  redis.call('HSET', key, 'run', run, 'step', step, 'p', p, 's', s, 'version', version,
             'prompt', prompt, 'n', 0, 'epoch', 0, 'owner', '', 'done', '0',
             'finish', '', 'instances', '', 'last', '', 'seen', 0, 'max', max_new)
  wrote(key)
end
