-- The keys scripts build from request ids and run ids, exactly as shared.names.Keys does:
-- every key of a run carries the run's hash tag, so a Redis Cluster keeps them on one slot.
local REQ, LEASE, HELD, RUN = '@REQUEST_PREFIX@', '@LEASE_PREFIX@', '@HELD_PREFIX@', '@RUN_PREFIX@'
local function run_of(rid)
  return string.sub(rid, 1, string.find(rid, ':', 1, true) - 1)
end
local function tagged(prefix, rid)  -- <prefix>{<run>}:<step>:<prompt>:<sample>
  local i = string.find(rid, ':', 1, true)
  return prefix .. '{' .. string.sub(rid, 1, i - 1) .. '}' .. string.sub(rid, i)
end
local function req_key(rid) return tagged(REQ, rid) end
local function lease_key(rid) return tagged(LEASE, rid) end
local function held_key(run, instance) return HELD .. '{' .. run .. '}:' .. instance end
local function run_key(run) return RUN .. '{' .. run .. '}' end
local function run_key_of(key)  -- the record of the run whose hash tag a key carries
  return run_key(string.match(key, '{(.-)}'))
end
