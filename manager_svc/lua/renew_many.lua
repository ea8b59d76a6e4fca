-- Renews the leases one instance reports, all of one run; returns the request ids no longer
-- the sender's. KEYS: the run's record key (names its slot) | ARGV: instance, ttl_ms, then
-- (rid, epoch, buffered) triples.
-- include: renew.lua
return renew_leases(ARGV[1], ARGV[2], 3, '', {})
