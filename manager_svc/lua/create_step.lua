-- Creates a step whose responses are all written (create_requests.lua): its hash, with
-- `created`, and the run's seeding state, in one change. Until this runs the step does not
-- exist for anybody (dispatch reads its hash), so a crash before it leaves nothing to undo
-- and the trainer's retry writes the responses again; after it, a retry changes nothing.
-- KEYS: step, seeding | ARGV: step fields, seeding fields (JSON lists of names and values)
-- include: keys.lua
-- include: retired.lua
if redis.call('HEXISTS', KEYS[1], 'created') == 1 then return 0 end
local function hset(key, flat)
  -- In slices: unpack() of a step with thousands of groups would overflow Lua's stack.
  for i = 1, #flat, 2000 do
    redis.call('HSET', key, unpack(flat, i, math.min(i + 1999, #flat)))
  end
end
hset(KEYS[1], cjson.decode(ARGV[1]))
hset(KEYS[2], cjson.decode(ARGV[2]))
redis.call('HSET', KEYS[1], 'created', '1')
after_retirement(run_key_of(KEYS[1]))
wrote(KEYS[1])
wrote(KEYS[2])
expire_late()
return 1
