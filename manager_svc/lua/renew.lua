-- Lease renewal, shared by renew_many.lua and beat_run.lua (included, not run alone).
-- For each (request id, epoch, buffered) triple of ARGV from index `first`: a request id that
-- does not start with `only` (a response of another run) goes to `lost`; so does one whose
-- lease is no longer the instance's; the rest are renewed. Returns `lost`.
-- include: keys.lua
local function renew_leases(instance, ttl_ms, first, only, lost)
  for i = first, #ARGV, 3 do
    local rid = ARGV[i]
    local lease = lease_key(rid)
    if string.sub(rid, 1, #only) == only and
        redis.call('GET', lease) == (instance .. ':' .. ARGV[i + 1]) then
      redis.call('PEXPIRE', lease, ttl_ms)
      -- Not on a response whose keys expired with its retired run while its lease (its own,
      -- shorter-lived TTL) still held: that HSET would make a hash with no TTL.
      if redis.call('EXISTS', req_key(rid)) == 1 then
        redis.call('HSET', req_key(rid), 'seen', ARGV[i + 2])
      end
    else
      lost[#lost + 1] = rid
    end
  end
  return lost
end
