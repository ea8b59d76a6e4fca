-- Writes that land after a run is retired. RunStore.retire gives every key of the run, its
-- record first, the retention time; a script that writes for the run later (a late commit, a
-- revoke or lease on a cancelled run, a trainer's late step) may create a key, or SET one
-- afresh, and such a key would have no TTL: in Redis for good. So a script that may write
-- reads the record's time left first (`after_retirement`), notes each key it may create or
-- reset (`wrote`), and gives them that time before it returns (`expire_late`): they expire
-- with the run. While the run lives its record has no TTL and none of this writes anything.
local late_ttl, late_keys = 0, {}
local function after_retirement(record)
  local ttl = redis.call('PTTL', record)
  late_ttl = ttl > 0 and ttl or 0
end
local function wrote(key)
  if late_ttl > 0 then late_keys[key] = true end
end
local function expire_late()
  for key in pairs(late_keys) do redis.call('PEXPIRE', key, late_ttl) end
  late_keys = {}
end
