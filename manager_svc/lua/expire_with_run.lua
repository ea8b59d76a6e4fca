-- The manager's own writes for a run that may be retired (an event, a warning, a counter) run
-- in a transaction with this script after them: once the run's record has a TTL the keys
-- written get its time left, as the scripts' writes do (retired.lua).
-- KEYS: the run's record, then the keys written. Returns the ms given (0: the run lives on).
-- include: retired.lua
after_retirement(KEYS[1])
for i = 2, #KEYS do wrote(KEYS[i]) end
expire_late()
return late_ttl
