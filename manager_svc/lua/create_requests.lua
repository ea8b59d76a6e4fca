-- Writes one batch of a step's responses, fresh, and adds them to its pending set; refused
-- (returns 0) once the step exists, so a batch re-run after its step was created can never
-- reset a response that was leased or committed meanwhile. Before that nothing reads them.
-- KEYS: step, pending | ARGV: run, step, version, max_new_tokens,
-- then (request id, prompt index, sample index, prompt tokens as CSV) per response
-- include: common.lua
if redis.call('HEXISTS', KEYS[1], 'created') == 1 then return 0 end
after_retirement(run_key_of(KEYS[1]))  -- a trainer writing a step of a run that ended
for i = 5, #ARGV, 4 do
  write_request(ARGV[i], ARGV[1], ARGV[2], ARGV[i + 1], ARGV[i + 2], ARGV[3],
                ARGV[i + 3], ARGV[4])
  redis.call('SADD', KEYS[2], ARGV[i])
end
wrote(KEYS[2])
expire_late()
return 1
