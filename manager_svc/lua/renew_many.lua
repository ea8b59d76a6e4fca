-- Renews the leases one heartbeat reports; returns the request ids no longer the sender's.
-- ARGV: lease_prefix, req_prefix, instance, ttl_ms, then (rid, epoch, buffered) triples.
-- One round trip per heartbeat however many responses the instance holds.
local lost = {}
for i = 5, #ARGV, 3 do
  local rid = ARGV[i]
  local lease = ARGV[1] .. rid
  if redis.call('GET', lease) == (ARGV[3] .. ':' .. ARGV[i + 1]) then
    redis.call('PEXPIRE', lease, ARGV[4])
    redis.call('HSET', ARGV[2] .. rid, 'seen', ARGV[i + 2])
  else
    lost[#lost + 1] = rid
  end
end
return lost
