-- Renews the leases one instance reports; returns the request ids no longer the sender's.
-- ARGV: lease_prefix, req_prefix, instance, ttl_ms, then (rid, epoch, buffered) triples.
-- include: renew.lua
return renew_leases(ARGV[1], ARGV[2], ARGV[3], ARGV[4], 5, '', {})
