-- Commits an environment's answer to one model turn of an agentic response, exactly once: the
-- observation's ids are appended to the response's tokens (masked out of the loss by the
-- trainer: the turn is recorded with its range), or the response ends. A second answer to
-- the same turn (a tool call run again after its worker died, a result delivered twice)
-- finds the turn answered already and changes nothing (docs/agentic.md).
-- KEYS: the run's record key (names the run's slot) | ARGV: now, the step's key, its
-- tool/pending/done suffixes, request id, turn (1-based model turn answered), observation ids
-- csv ("" none), their count, call id, observation text, done ("1": the environment ended the
-- response), environment reward ("" none).
-- Returns "<status> <n>": duplicate | unknown | ok (pending again) | final | group | step
-- (the response ended, as commit.lua's), n its committed length.
-- include: common.lua
local now, step, rid, turn = ARGV[1], ARGV[2], ARGV[6], ARGV[7]
after_retirement(KEYS[1])
local req = req_key(rid)
local st = redis.call('HMGET', req, 'done', 'turn', 'n', 'max', 'p', 'obs')
if not st[2] then return 'unknown 0' end
local n = tonumber(st[3])
-- Answered already (done, or the response moved past the turn), or not asked yet.
if st[1] ~= '0' or st[2] ~= turn then return 'duplicate ' .. n end
local tool = step .. ARGV[3]
if redis.call('SREM', tool, rid) == 0 then return 'duplicate ' .. n end
wrote(tool)
redis.call('HINCRBY', step, 'tool_calls_committed', 1)
redis.call('HDEL', req, 'claim_until')  -- the next turn's call is a new one
local max = tonumber(st[4])
local finish = ''
if ARGV[13] ~= '' then redis.call('HSET', req, 'env_reward', ARGV[13]) end
if ARGV[12] == '1' then
  finish = 'stop'
elseif tonumber(turn) >= tonumber(redis.call('HGET', step, 'max_turns') or '1') then
  finish = 'turns'  -- the last model turn allowed was answered with more to do
else
  local ids, count = ARGV[8], tonumber(ARGV[9])
  if n + count >= max then  -- no room to answer and go on: what fits, then the budget ends it
    local kept, taken = {}, 0
    for id in string.gmatch(ids, '[^,]+') do
      if n + taken >= max then break end
      kept[#kept + 1] = id
      taken = taken + 1
    end
    ids, count, finish = table.concat(kept, ','), taken, 'length'
  end
  local turns = cjson.decode(st[6] or '[]')
  if count > 0 then
    redis.call('APPEND', req .. TOKENS, n == 0 and ids or (',' .. ids))
    wrote(req .. TOKENS)
    if redis.call('STRLEN', req .. LOGPROBS) == 8 * n then
      -- An observation was not sampled: 0.0 (float32 zero) keeps the log-probs aligned with
      -- the tokens; masked out of the loss, it is never read as a probability.
      redis.call('APPEND', req .. LOGPROBS, string.rep('00000000', count))
      wrote(req .. LOGPROBS)
    end
  end
  turns[#turns + 1] = {n, n + count, ARGV[10], ARGV[11]}  -- start, end, call id, text
  n = n + count
  redis.call('HSET', req, 'obs', cjson.encode(turns))
  redis.call('HINCRBY', step, 'tokens_observed', count)
end
redis.call('HSET', req, 'n', n, 'progress_at', now)
if finish == '' then
  redis.call('SADD', step .. ARGV[4], rid)  -- pending: whoever is leased it goes on from here
  wrote(step .. ARGV[4])
  return 'ok ' .. n
end
redis.call('HSET', req, 'done', '1', 'finish', finish)
redis.call('SADD', step .. ARGV[5], rid)
wrote(step .. ARGV[5])
local left = redis.call('HINCRBY', step, 'g:' .. st[5], -1)
local remaining = redis.call('HINCRBY', step, 'remaining', -1)
if remaining == 0 then return 'step ' .. n end
if left == 0 then return 'group ' .. n end
return 'final ' .. n
