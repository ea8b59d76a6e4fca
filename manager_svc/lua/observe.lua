-- Records what a heartbeat shows about an instance in a run's event stream: that it joined the
-- run (its first beat under this session while the run is active) and each weight version it
-- loads. One script, so two beats of one instance can never both record the same change.
-- KEYS: the run's instances hash, the run's events stream
-- ARGV: instance id, session, kind, loaded version (-1: none of this run), stream cap
local seen = redis.call('HGET', KEYS[1], ARGV[1])
local session, version = '', '-1'
if seen then
  session, version = string.match(seen, '^(.*)|(-?%d+)$')
end
if seen == false or session ~= ARGV[2] then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'type', 'join', 'instance', ARGV[1],
             'kind', ARGV[3], 'version', ARGV[4])
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '|' .. ARGV[4])
  return 1
end
if ARGV[4] ~= version and tonumber(ARGV[4]) >= 0 then
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'type', 'version', 'instance',
             ARGV[1], 'kind', ARGV[3], 'version', ARGV[4])
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. '|' .. ARGV[4])
  return 2
end
return 0
