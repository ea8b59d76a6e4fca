-- The responses of a step's leased set whose lease has committed nothing for `bound` seconds:
-- the dispatcher's progress check (a holder that heartbeats but whose engine hung keeps its
-- lease alive forever; only its commits say whether it moves). One call per reap, as
-- expired_leases.lua, rather than a read per leased response.
-- KEYS: the step's leased set | ARGV: now (seconds), bound (seconds)
-- Returns a flat list: request id, owner, seconds since its last commit (or its grant), ...
-- include: keys.lua
local now, bound = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {}
for _, rid in ipairs(redis.call('SMEMBERS', KEYS[1])) do
  local st = redis.call('HMGET', req_key(rid), 'progress_at', 'assigned_at', 'owner', 'done')
  -- A lease granted by a manager older than the field is judged from its grant.
  local last = tonumber(st[1] or st[2] or '')
  if last and st[4] ~= '1' and st[3] and st[3] ~= '' and now - last >= bound then
    out[#out + 1] = rid
    out[#out + 1] = st[3]
    out[#out + 1] = string.format('%.3f', now - last)
  end
end
return out
