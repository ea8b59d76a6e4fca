-- Clears the active run if it is still ARGV[1] (a run that ended or was cancelled): a later
-- activation of another run is never undone. KEYS: active | ARGV: run id. Returns 1 if cleared.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
return 1
