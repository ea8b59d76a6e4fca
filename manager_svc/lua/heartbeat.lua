-- One heartbeat, one call: registers it, reads the run instances should serve, records what
-- the beat shows in that run's events and renews the leases it reports of that run. (Four
-- round trips in a row before, ~0.8 ms of the manager's time a beat: 256 beats a second at
-- 128 instances were a third of its event loop.)
-- Registration and departure are ordered by Redis: a beat that a process sent just before it
-- released its work either lands first (and is then forgotten by the release) or finds the
-- departure mark and is refused, so a leaver never reappears as alive.
-- KEYS: instance, instances, instance's held set, departed, identity (auth callout), active
-- ARGV: 1 fields (JSON list of alternating names and values), 2 ttl_ms, 3 session,
--   4 instance id, 5 now, 6 run key prefix, 7 run-instances suffix, 8 events key prefix,
--   9 the run the beat's version is of, 10 that version (-1: none), 11 kind, 12 events cap,
--   13 lease prefix, 14 request prefix, 15 lease ttl_ms, then (rid, epoch, buffered) triples.
-- Returns nil if the process left, else {held ids, run ('' none), its step, ids to drop}.
-- include: observe.lua
-- include: renew.lua
local departed = redis.call('GET', KEYS[4])
if ARGV[3] ~= '' and departed == ARGV[3] then return false end
if redis.call('HGET', KEYS[1], 'session') ~= ARGV[3] then
  redis.call('HSET', KEYS[1], 'joined_at', ARGV[5])  -- a new process under this id
end
redis.call('HSET', KEYS[1], unpack(cjson.decode(ARGV[1])))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('PEXPIRE', KEYS[5], ARGV[2])  -- the id stays bound to its key while it beats
redis.call('SADD', KEYS[2], ARGV[4])
local held = redis.call('SMEMBERS', KEYS[3])
-- The run being trained, if it still runs (activating the next one is RunStore.active's).
local run = redis.call('GET', KEYS[6])
local step = ''
if run and redis.call('HGET', ARGV[6] .. run, 'state') == 'running' then
  step = redis.call('HGET', ARGV[6] .. run, 'step') or '0'
else
  run = ''
end
if run == '' then  -- no run to serve: whatever it holds, it drops
  local drop = {}
  for i = 16, #ARGV, 3 do drop[#drop + 1] = ARGV[i] end
  return {held, run, step, drop}
end
local version = ARGV[9] == run and ARGV[10] or '-1'
observe(ARGV[6] .. run .. ARGV[7], ARGV[8] .. run, ARGV[4], ARGV[3], ARGV[11], version, ARGV[12])
-- Leases of another run are dropped; the rest are renewed if they are still the sender's.
return {held, run, step, renew_leases(ARGV[13], ARGV[14], ARGV[4], ARGV[15], 16, run .. ':', {})}
