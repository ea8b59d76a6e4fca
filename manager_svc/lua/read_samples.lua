-- Reads what many responses have stored, in one call. A pipeline of an HMGET and a GET per
-- response cost the manager a packed command, a parsed reply and an asyncio timeout each:
-- ~35 % of the barrier's time at 1,024 responses. Read-only; keys are derived from the ids,
-- as the commit script derives them.
-- ARGV: request key prefix, then request ids
-- Returns, per id in order: {p, s, version, prompt, tokens, finish, instances}, each false
-- where absent; tokens are the response's own string, or its hash field for a response
-- committed before responses kept their tokens apart (never moved since).
local out = {}
for i = 2, #ARGV do
  local req = ARGV[1] .. ARGV[i]
  local row = redis.call('HMGET', req, 'p', 's', 'version', 'prompt', 'tokens', 'finish',
                         'instances')
  local text = redis.call('GET', req .. '@TOKENS_SUFFIX@')
  if text and text ~= '' then
    row[5] = text
  end
  out[#out + 1] = row
end
return out
