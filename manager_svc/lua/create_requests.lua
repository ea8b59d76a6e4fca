-- Writes one batch of a step's responses, fresh, and adds them to its pending set; refused
-- (returns 0) once the step exists, so a batch re-run after its step was created can never
-- reset a response that was leased or committed meanwhile. Before that nothing reads them.
-- KEYS: step, pending | ARGV: request key prefix, run, step, version, max_new_tokens,
-- then (request id, prompt index, sample index, prompt tokens as CSV) per response
if redis.call('HEXISTS', KEYS[1], 'created') == 1 then return 0 end
for i = 6, #ARGV, 4 do
  local rid = ARGV[i]
  redis.call('DEL', ARGV[1] .. rid)
  redis.call('HSET', ARGV[1] .. rid, 'run', ARGV[2], 'step', ARGV[3], 'p', ARGV[i + 1],
             's', ARGV[i + 2], 'version', ARGV[4], 'prompt', ARGV[i + 3], 'tokens', '', 'n', 0,
             'epoch', 0, 'owner', '', 'done', '0', 'finish', '', 'instances', '', 'last', '',
             'seen', 0, 'max', ARGV[5])
  redis.call('SADD', KEYS[2], rid)
end
return 1
