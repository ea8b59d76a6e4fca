-- A heartbeat's registration, on the control keys (its run's part is beat_run.lua): records
-- the instance as alive and answers the run instances should serve. (Four round trips in a
-- row before these two scripts, ~0.8 ms of the manager's time a beat: 256 beats a second at
-- 128 instances were a third of its event loop.)
-- Registration and departure are ordered by Redis: a beat that a process sent just before it
-- released its work either lands first (and is then forgotten by the release) or finds the
-- departure mark and is refused, so a leaver never reappears as alive.
-- KEYS: instance, instances, departed, identity (auth callout), active
-- ARGV: fields (JSON list of alternating names and values), ttl_ms, session, instance id, now,
-- the engine's decode steps, '1' if the instance reports holding work, the fingerprint of the
-- sender's key its subject names ('' none)
-- Returns false if the process left, 0 if the id is bound to another key, else the active
-- run's id ('' none; whether it still runs is beat_run.lua's to read: activating the next one
-- is RunStore.active's).
local departed = redis.call('GET', KEYS[3])
if ARGV[3] ~= '' and departed == ARGV[3] then return false end
-- The id is bound to one key ("<kind>:<public nkey>") while it lives: a beat under another
-- key's fingerprint (shared.names.fingerprint: the key's characters 2 to 17) comes from an
-- older connection under the id, superseded. (No binding: the callout is off, or the id's
-- binding lapsed and no process has claimed it since.)
local bound = redis.call('GET', KEYS[4])
if bound and string.sub(string.match(bound, ':(.*)$') or '', 2, 17) ~= ARGV[8] then
  return 0
end
local fresh = redis.call('HGET', KEYS[1], 'session') ~= ARGV[3]
if fresh then
  redis.call('HSET', KEYS[1], 'joined_at', ARGV[5])  -- a new process under this id
end
-- Engine liveness: steps_at is when its decode-step count last moved while it held work. An
-- idle engine has nothing to advance: its clock starts again each beat it holds nothing.
if fresh or ARGV[7] ~= '1' or redis.call('HGET', KEYS[1], 'decode_steps') ~= ARGV[6] then
  redis.call('HSET', KEYS[1], 'decode_steps', ARGV[6], 'steps_at', ARGV[5])
end
redis.call('HSET', KEYS[1], unpack(cjson.decode(ARGV[1])))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[4], ARGV[2])  -- the id stays bound to its key while it beats
redis.call('SADD', KEYS[2], ARGV[4])
return redis.call('GET', KEYS[5]) or ''
