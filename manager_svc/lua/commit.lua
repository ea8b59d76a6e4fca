-- Commits token frames' entries in order, each exactly as if alone (a frame only saves messages,
-- round trips and script calls; every entry is still checked against its own response's lease,
-- epoch and offset). KEYS: the run's record key (names the run's slot; every entry is of that
-- run). ARGV: now, leased/done/pending/tool suffixes of the step key, then one JSON array per
-- frame: [instance, kind, entries], an entry
-- being [request id, epoch, version, offset, ntok, tokens csv, final, finish, step key,
-- log-probs hex ("" for none)] (see
-- Ledger._frame_arg; one argument per frame, as packing arguments was most of the commit's
-- CPU). Returns "status n,status n,..." per entry, in order.
-- include: common.lua
local now = ARGV[1]
after_retirement(KEYS[1])  -- a late frame of a retired run: what it creates expires with it
-- Step counters are summed here and written once per script: Redis time per chunk is the
-- commit's ceiling, and the script is atomic, so nobody can see them half-applied.
local counts, firsts, lasts = {}, {}, {}
local function count(step, field, by)
  counts[step] = counts[step] or {}
  counts[step][field] = (counts[step][field] or 0) + by
end
local function commit(rid, inst, epoch_s, version, offset, ntok, tokens, final, finish, kind,
                      step, logprobs)
  local req, lease, leased = req_key(rid), lease_key(rid), step .. ARGV[2]
  local st = redis.call('HMGET', req, 'done', 'epoch', 'n', 'version', 'max', 'last', 'p',
                        'tokens', 'turn')
  if not st[2] then return 'unknown', 0 end  -- every request hash has an epoch
  local epoch = tonumber(epoch_s)
  local cur, n = tonumber(st[2]), tonumber(st[3])
  if st[1] == 'aborted' then  -- dynamic sampling closed its step: work thrown away
    count(step, 'tokens_discarded', ntok)
    return 'aborted', n
  end
  if st[1] == '1' then
    if epoch == cur then
      count(step, 'duplicate_chunks_dropped', 1)
      return 'duplicate', n
    end
    count(step, 'stale_chunks_rejected', 1)
    count(step, 'tokens_regenerated', ntok)
    return 'stale', n
  end
  -- An agentic response's turn ended with the lease: a copy of the turn's entries delivered
  -- again finds no lease, and is a duplicate, not stale work.
  if st[9] and epoch == cur and ((ntok > 0 and offset + ntok <= n) or (ntok == 0 and offset < n))
  then
    count(step, 'duplicate_chunks_dropped', 1)
    return 'duplicate', n
  end
  if epoch ~= cur or redis.call('GET', lease) ~= (inst .. ':' .. epoch_s) then
    count(step, 'stale_chunks_rejected', 1)
    count(step, 'tokens_regenerated', ntok)
    return 'stale', n
  end
  if (ntok > 0 and offset + ntok <= n) or (ntok == 0 and offset < n) then
    count(step, 'duplicate_chunks_dropped', 1)
    return 'duplicate', n
  end
  local function revoke(why, counter)
    count(step, counter, 1)
    redis.call('HINCRBY', req, 'epoch', 1)
    redis.call('DEL', lease)
    release_owner(req, rid)
    redis.call('SMOVE', leased, step .. ARGV[4], rid)
    wrote(step .. ARGV[4])
    count(step, 'tokens_regenerated', ntok)
    return why, n
  end
  if offset ~= n then return revoke('gap', 'gaps') end
  if tonumber(version) ~= tonumber(st[4]) then
    return revoke('wrong_version', 'wrong_version_chunks')
  end
  if n + ntok > tonumber(st[5]) then return revoke('overlong', 'overlong_chunks') end
  if ntok > 0 then
    take_legacy_tokens(req, st[8])  -- st[8] is nil for every response written since
    redis.call('APPEND', req .. TOKENS, n == 0 and tokens or (',' .. tokens))
    wrote(req .. TOKENS)
    if logprobs ~= '' then
      -- With the tokens, under the same checks: exactly once. A response some entry of which
      -- had none keeps fewer than its tokens, which reads as unknown (accounting).
      redis.call('APPEND', req .. LOGPROBS, logprobs)
      wrote(req .. LOGPROBS)
    end
    n = n + ntok
    -- When the lease last moved: the no-progress check (stalled_leases.lua) reads it.
    redis.call('HSET', req, 'n', n, 'progress_at', now)
    count(step, 'tokens', ntok)
    count(step, 'tokens_' .. kind, ntok)
    firsts[step .. '|' .. kind] = {step, kind .. '_first_at'}
    lasts[step .. '|' .. kind] = {step, kind .. '_last_at'}
    if st[6] ~= inst then
      csv_append(req, 'instances', inst)
      redis.call('HSET', req, 'last', inst)
    end
  end
  if final ~= '1' then return 'ok', n end
  if finish == 'stop' and tonumber(redis.call('HGET', step, 'max_turns') or '1') > 1 then
    -- A model turn of an agentic run ended: its lease ends with it, and the response waits,
    -- leased to nobody, for its environment's answer (turn.lua); 'tool' tells ingest to ask.
    redis.call('HINCRBY', req, 'turn', 1)
    redis.call('HSET', req, 'await_at', now)
    redis.call('DEL', lease)
    release_owner(req, rid)
    redis.call('SMOVE', leased, step .. ARGV[5], rid)
    wrote(step .. ARGV[5])
    return 'tool', n
  end
  redis.call('HSET', req, 'done', '1', 'finish', finish)
  redis.call('DEL', lease)
  release_owner(req, rid)
  redis.call('SREM', leased, rid)
  redis.call('SADD', step .. ARGV[3], rid)
  wrote(step .. ARGV[3])
  local left = redis.call('HINCRBY', step, 'g:' .. st[7], -1)
  local remaining = redis.call('HINCRBY', step, 'remaining', -1)
  if remaining == 0 then return 'step', n end
  if left == 0 then return 'group', n end
  return 'final', n
end
local out = {}
for i = 6, #ARGV do
  local f = cjson.decode(ARGV[i])
  local inst, kind = f[1], f[2]
  for _, e in ipairs(f[3]) do
    local status, n = commit(e[1], inst, e[2], e[3], e[4], e[5], e[6], e[7] and '1' or '0',
                             e[8], kind, e[9], e[10] or '')
    out[#out + 1] = status .. ' ' .. n
  end
end
for step, fields in pairs(counts) do
  for field, by in pairs(fields) do redis.call('HINCRBY', step, field, by) end
  wrote(step)
end
for _, first in pairs(firsts) do redis.call('HSETNX', first[1], first[2], now) end
-- When each kind last generated: a step's reserved side may stop long before its barrier
-- (spot instances joined late took the rest), and its rate is measured up to here.
for _, last in pairs(lasts) do redis.call('HSET', last[1], last[2], now) end
expire_late()
return table.concat(out, ',')  -- one string: far cheaper to parse than a reply per chunk
