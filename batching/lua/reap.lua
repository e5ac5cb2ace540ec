-- reap: take back expired leases (their worker died or hung), forget old dead letters.
-- K.lease_expiry  K.attempts  K.pending  K.sched
-- K.dead    K.settings  K.depth  K.stats  K.requests
-- K.history  K.fair  K.fair_tenants  K.vtc  K.lease_ids
-- K.leased  ZSET id -> expiry   K.owner  HASH id -> token: the per-request leases of
--           versions before per-claim ones, taken back as before
-- KEYS[FIXED+1..] result keys, reply lists, reader marks and bells of requests a previous
--   call returned as `undeclared` (none on a first call)
-- ARGV[1] result key prefix   ARGV[2] reply list prefix
-- ARGV[3] default max_attempts   ARGV[4] default result_ttl   ARGV[5] most to reap now
--         (a lapsed claim's lease is taken back whole), and most dead letters to forget
-- ARGV[6] default dead_ttl
-- Each expired lease counts as a failed attempt, recorded in `history`: the request
-- goes back to pending at its original rank (it keeps its place), or is dead-lettered
-- after max_attempts, its error the last runner error (else LeaseExpired) followed by
-- how each attempt ended. Dead-lettering writes the request's result key (and its
-- client's reply list): one not declared is left as it is and returned, for the caller
-- to declare in a second call.
-- Dead letters older than dead_ttl are forgotten (up to ARGV[5] of them): their working
-- state and their `dead` entry go, so the id may be enqueued afresh.
-- Returns {requeued, dead, forgotten, n, n/2 undeclared pairs (id, client), the ids
--   requeued, the ids dead-lettered}.
local result_prefix, reply_prefix = ARGV[1], ARGV[2]
local max_attempts = setting(K.settings, 'max_attempts', tonumber(ARGV[3]))
local ttl = setting(K.settings, 'result_ttl', tonumber(ARGV[4]))
local dead_ttl = setting(K.settings, 'dead_ttl', tonumber(ARGV[6]))
local now = now_ms()
local requeued, dead, counts, undeclared = 0, 0, {}, {}
local requeued_ids, dead_ids = {}, {}

-- Dead-letter s's request when this lapse is its last attempt: false when its keys
-- were not declared (nothing written then).
local function lapse(id, s)
  local failures = tonumber(rcall('HGET', K.attempts, id) or '0') + 1
  if failures >= max_attempts then
    local keys_declared = DECLARED[result_prefix .. id] and
      (s.client == '' or reply_key(reply_prefix, s.client))
    if not keys_declared then return false end
  end
  rcall('ZREM', K.leased, id)
  rcall('HDEL', K.owner, id)
  rcall('HSET', K.attempts, id, failures)
  local history = record_ending(K.history, id, LEASE_EXPIRED, max_attempts)
  if failures >= max_attempts then
    local json = cjson.encode({id = id, status = 'dead', output = cjson.null,
      error = dead_error(history, failures, nil),
      attempts = failures, worker = cjson.null, batch_size = cjson.null,
      queued_ms = now - s.enq, run_ms = cjson.null})
    dead_letter(K.dead, result_prefix, reply_prefix, id, s.client, json, ttl, dead_ttl, now)
    dead = dead + 1
    dead_ids[dead] = id
  else
    requeue(K, id, s, counts)
    requeued = requeued + 1
    requeued_ids[requeued] = id
  end
  return true
end

-- Take back a request whose lease lapsed: false when it is left for a second call
-- (its keys were not declared).
local function take_back(id)
  local raw = rcall('HGET', K.sched, id)
  if rcall('HEXISTS', K.requests, id) == 0 then
    rcall('ZREM', K.leased, id)  -- nothing left to run
    rcall('HDEL', K.owner, id)
    rcall('HDEL', K.sched, id)
    rcall('HDEL', K.attempts, id)
    rcall('HDEL', K.history, id)
    return true
  end  -- (an entry missing or unreadable: back to be handed to a worker that fails it)
  local s = parse_sched(raw or '')
  if lapse(id, s) then return true end
  undeclared[#undeclared + 1] = id
  undeclared[#undeclared + 1] = s.client
  return false
end

-- each lapsed lease: the ids its claim still holds; it ends once none is left
local limit = tonumber(ARGV[5])
local budget = limit
for _, token in ipairs(rcall('ZRANGEBYSCORE', K.lease_expiry, '-inf', now, 'LIMIT', 0, limit)) do
  if budget <= 0 then break end
  local ids, left = lease_read(K, token), {}
  budget = budget - #ids
  rcall('HDEL', K.lease_ids, token)  -- first (_common.lua lease_drop: maxmemory)
  for _, id in ipairs(ids) do
    if not take_back(id) then left[#left + 1] = id end
  end
  lease_put(K, token, left)
end
for _, id in ipairs(rcall('ZRANGEBYSCORE', K.leased, '-inf', now, 'LIMIT', 0, math.max(0, budget))) do
  take_back(id)
end
add_depth(K.depth, counts)
if requeued > 0 then rcall('HINCRBY', K.stats, 'reaped', requeued) end
if dead > 0 then rcall('HINCRBY', K.stats, 'dead', dead) end
local stale = rcall('ZRANGEBYSCORE', K.dead, '-inf', now - dead_ttl * 1000, 'LIMIT', 0, limit)
if #stale > 0 then
  call_chunked('ZREM', K.dead, stale)
  forget(K, stale)
end
local reply = {requeued, dead, #stale, #undeclared}
for _, list in ipairs({undeclared, requeued_ids, dead_ids}) do
  for _, v in ipairs(list) do reply[#reply + 1] = v end
end
return reply
