-- Reads what many responses have stored, in one call. A pipeline of an HMGET and a GET per
-- response cost the manager a packed command, a parsed reply and an asyncio timeout each:
-- ~35 % of the barrier's time at 1,024 responses. Read-only; keys are derived from the ids,
-- as the commit script derives them.
-- KEYS: the run's record key (names its slot) | ARGV: request ids, all of that run
-- Returns, per id in order: {p, s, version, prompt, tokens, finish, instances, obs,
-- env_reward, logprobs, versions}, each false where absent (obs: an agentic response's
-- observation turns, turn.lua; logprobs: the behaviour log-probs' hex; versions: an
-- asynchronous run's "<first token>:<version>" list, assign.lua); tokens are the response's own
-- string, or its hash field for a response committed before responses kept their tokens
-- apart (never moved since).
-- include: keys.lua
local out = {}
for i = 1, #ARGV do
  local req = req_key(ARGV[i])
  local row = redis.call('HMGET', req, 'p', 's', 'version', 'prompt', 'tokens', 'finish',
                         'instances', 'obs', 'env_reward')
  local text = redis.call('GET', req .. '@TOKENS_SUFFIX@')
  if text and text ~= '' then
    row[5] = text
  end
  row[10] = redis.call('GET', req .. '@LOGPROBS_SUFFIX@')
  row[11] = redis.call('HGET', req, 'versions')
  out[#out + 1] = row
end
return out
