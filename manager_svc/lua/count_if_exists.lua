-- Adds to a counter of a step's record, only if the step exists: a forged or garbled request
-- id names a step that may not, and must not create its key (manager_svc.chunk_auth).
-- KEYS: step | ARGV: field, n
if redis.call('EXISTS', KEYS[1]) == 1 then
  return redis.call('HINCRBY', KEYS[1], ARGV[1], ARGV[2])
end
return 0
