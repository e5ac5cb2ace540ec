-- cancel: cancel requests by id; queued ones never run, running ones are discarded.
-- K.pending  K.delayed  K.lease_expiry  K.requests
-- K.sched    K.attempts K.settings K.depth  K.stats
-- K.history  K.fair  K.fair_tenants  K.vtc  K.lease_ids
-- KEYS[FIXED+1..] the cancelled-lease key of each id (Keys.cancelled), then its result
--   key, then the reply list, reader mark and bell of each client among them (found by
--   name: batching/calls.py cancel_call)
-- ARGV[1] result key prefix   ARGV[2] reply list prefix   ARGV[3] default result_ttl
-- ARGV[4] cancelled-lease key prefix
-- ARGV[5..] pairs: id, the cancelled result JSON
-- Returns {c1..cN}: 1 cancelled while queued; 2 cancelled while running (the worker's
--   result will be discarded); 3 cancelled already (its result says so: an earlier
--   cancel, or this very call retried after its reply was lost); 0 not cancellable
--   (finished otherwise, dead or unknown).
-- A running request's lease token is kept under its cancelled-lease key for
-- CANCELLED_LEASE_S: the one worker that held the lease may then attach the output it
-- had generated to this cancelled result, once (lua/attach.lua: generation's partial
-- text). The result committed here is the request's one result either way.
local CANCELLED_LEASE_S = 60
local result_prefix, reply_prefix, cancelled_prefix = ARGV[1], ARGV[2], ARGV[4]
local ttl = setting(K.settings, 'result_ttl', tonumber(ARGV[3]))
local flags, counts, gone, leases = {}, {}, {}, lease_book(K)
for i = 5, #ARGV, 2 do
  local id = ARGV[i]
  local flag = 0
  local raw = rcall('HGET', K.sched, id)
  if raw then
    if rcall('ZREM', K.pending, id) == 1 or rcall('ZREM', K.delayed, id) == 1 then
      flag = 1
    else
      local token = leases.holder(id)
      if token then
        flag = 2
        local key = cancelled_prefix .. id
        if not DECLARED[key] then error('batchery: cancelled-lease key not declared: ' .. key) end
        rcall('SET', key, token, 'EX', CANCELLED_LEASE_S)
        leases.let_go(id, token)
      end
    end
  else
    local ok, result = pcall(cjson.decode, result_text(result_key(result_prefix, id)) or 'null')
    if ok and type(result) == 'table' and result.status == 'cancelled' then flag = 3 end
  end
  if flag == 1 or flag == 2 then
    local s = parse_sched(raw)
    if flag == 1 then
      count_queued(counts, s.class, s.tenant, -1)
      -- out of its sub-queue now, not when a claim would find it gone
      if rcall('ZREM', K.fair, fair_member(s.class, s.tenant, s.rank, id)) == 1 then
        fair_charge(K, s.class, s.tenant, 0, 1)
      end
    end
    commit_result(result_prefix, reply_prefix, id, s.client, ARGV[i + 1], ttl)
    gone[#gone + 1] = id
  end
  flags[#flags + 1] = flag
end
if #gone > 0 then
  forget(K, gone)
  leases.settle()
  rcall('HINCRBY', K.stats, 'cancelled', #gone)
end
add_depth(K.depth, counts)
return flags
