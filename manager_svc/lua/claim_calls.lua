-- Hands out a step's awaited environment calls that no live tool worker holds: each claimed
-- for a while (a worker that dies with it loses it when the claim lapses, and the call is
-- handed out again: at-least-once, the same call id; turn.lua commits one answer). Nothing
-- here is in memory: a restarted manager hands out the same calls.
-- KEYS: the run's record key (names the run's slot) | ARGV: now (ms), the step's tool set key,
-- claim length (ms), most calls to hand out. Returns the request ids claimed.
-- include: common.lua
local now, ttl, limit = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4])
after_retirement(KEYS[1])
local out = {}
for _, rid in ipairs(redis.call('SMEMBERS', ARGV[2])) do
  if #out >= limit then break end
  local req = req_key(rid)
  if tonumber(redis.call('HGET', req, 'claim_until') or '0') <= now then
    redis.call('HSET', req, 'claim_until', now + ttl)
    wrote(req)
    out[#out + 1] = rid
  end
end
return out
