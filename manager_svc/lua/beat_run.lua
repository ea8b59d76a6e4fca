-- A heartbeat's part in the run it serves (after beat.lua): reads the run's step, records what
-- the beat shows in the run's events and renews the leases it reports of the run.
-- KEYS: run, the instance's held set of the run, run instances, events
-- ARGV: 1 run id, 2 instance id, 3 session, 4 the run the beat's version is of, 5 that version
--   (-1: none), 6 kind, 7 events cap, 8 lease ttl_ms, then (rid, epoch, buffered) triples.
-- Returns {held ids, step or false if the run no longer runs, ids to drop}.
-- include: observe.lua
-- include: renew.lua
local run = ARGV[1]
local st = redis.call('HMGET', KEYS[1], 'state', 'step')
if st[1] ~= 'running' then  -- it ended since beat.lua read it: whatever it holds, it drops
  local drop = {}
  for i = 9, #ARGV, 3 do drop[#drop + 1] = ARGV[i] end
  return {{}, false, drop}
end
local held = redis.call('SMEMBERS', KEYS[2])
local version = ARGV[4] == run and ARGV[5] or '-1'
observe(KEYS[3], KEYS[4], ARGV[2], ARGV[3], ARGV[6], version, ARGV[7])
-- Leases of another run are dropped; the rest are renewed if they are still the sender's.
return {held, st[2] or '0', renew_leases(ARGV[2], ARGV[8], 9, run .. ':', {})}
