-- Dynamic sampling: adds prompts to a step short of informative groups (Ledger.extend_step).
-- One script: the new responses, their groups' counters and the step's totals change together,
-- so a manager killed around it leaves the step extended or not, never half; a retry with the
-- same first index after it applied changes nothing and answers the step's prompt count.
-- KEYS: step, pending | ARGV: first index, samples per prompt, max prompts,
-- max_new_tokens, run id, step, then (request id, prompt index, sample index, prompt tokens as CSV) per response
-- Returns the step's prompt count, or -1 (no dynamic step), -2 (closed, or another first
-- index than the step's count), -3 (past max prompts).
-- include: common.lua
local st = redis.call('HMGET', KEYS[1], 'created', 'dynamic', 'closed', 'prompts', 'version')
if st[1] ~= '1' or st[2] ~= '1' then return -1 end
local have, first, samples = tonumber(st[4]), tonumber(ARGV[1]), tonumber(ARGV[2])
local added = (#ARGV - 6) / 4 / samples
if have >= first + added then return have end
if have ~= first or st[3] == '1' then return -2 end
if first + added > tonumber(ARGV[3]) then return -3 end
after_retirement(run_key_of(KEYS[1]))
for i = 7, #ARGV, 4 do
  write_request(ARGV[i], ARGV[5], ARGV[6], ARGV[i + 1], ARGV[i + 2], st[5],
                ARGV[i + 3], ARGV[4])
  redis.call('SADD', KEYS[2], ARGV[i])
end
for p = first, first + added - 1 do redis.call('HSET', KEYS[1], 'g:' .. p, samples) end
redis.call('HINCRBY', KEYS[1], 'total', added * samples)
redis.call('HINCRBY', KEYS[1], 'remaining', added * samples)
redis.call('HSET', KEYS[1], 'prompts', first + added)
wrote(KEYS[1])
wrote(KEYS[2])
expire_late()
return first + added
