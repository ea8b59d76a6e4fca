-- What a heartbeat shows about an instance, in a run's event stream (included by beat_run.lua):
-- that it joined the run (its first beat under this session while the run is active) and each
-- weight version it loads. One script, so two beats of one instance can never both record the
-- same change. `version` -1: it has loaded none of this run.
local function observe(instances_key, stream, instance, session, kind, version, cap)
  local seen = redis.call('HGET', instances_key, instance)
  -- This process released its work and left (InstanceEvents.left): a beat of it that was
  -- still in flight shows nothing new.
  if seen == session .. '|left' then return end
  local was_session, was_version = '', '-1'
  if seen then
    was_session, was_version = string.match(seen, '^(.*)|(-?%d+)$')
  end
  if seen == false or was_session ~= session then
    redis.call('XADD', stream, 'MAXLEN', '~', cap, '*', 'type', 'join', 'instance', instance,
               'kind', kind, 'version', version)
    redis.call('HSET', instances_key, instance, session .. '|' .. version)
  elseif version ~= was_version and tonumber(version) >= 0 then
    redis.call('XADD', stream, 'MAXLEN', '~', cap, '*', 'type', 'version', 'instance', instance,
               'kind', kind, 'version', version)
    redis.call('HSET', instances_key, instance, session .. '|' .. version)
  end
end
