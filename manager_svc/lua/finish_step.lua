-- Record a finished step and advance its run, only while the run is still at that step: a
-- finish whose commands reached Redis late (its client timed out, so the trainer retried and
-- the retry recorded the step already) must not append a second record.
-- KEYS: run, samples, step records (the caller clears it as active after its last step)
-- ARGV: step, samples json, record json, now, checkpoints json ("" = unchanged), last (1|0)
-- Returns 1 if recorded, 0 if the run had moved on.
-- include: retired.lua
if tonumber(redis.call('HGET', KEYS[1], 'step')) ~= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[2], ARGV[2])
redis.call('RPUSH', KEYS[3], ARGV[3])
redis.call('HSET', KEYS[1], 'step', tonumber(ARGV[1]) + 1, 'updated_at', ARGV[4])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'checkpoints', ARGV[5]) end
if ARGV[6] == '1' then redis.call('HSET', KEYS[1], 'state', 'succeeded') end
-- A cancelled run's trainer may finish the step it was at after the run was retired: SET
-- gives the samples no TTL, and the records list may be new.
after_retirement(KEYS[1])
wrote(KEYS[2])
wrote(KEYS[3])
expire_late()
return 1
