-- enqueue: accept requests into a queue, idempotent by id, all or nothing.
-- K.pending    ZSET id -> rank
-- K.requests   HASH id -> request JSON
-- K.sched      HASH id -> "tokens:expire_ms:enqueued_ms:rank:class:client:tenant"
-- K.settings   HASH (QueueSettings)
-- K.wake       LIST idle workers block on
-- K.depth      HASH class -> queued count
-- K.delayed    ZSET (counts toward max_pending)
-- K.stats      HASH of totals
-- K.dead       ZSET dead letters   K.attempts   K.history
-- K.call       STRING this call's reply, remembered (see Returns)
-- K.fair  K.fair_tenants  K.vtc   the tenants' sub-queues and
--         counters (_common.lua fair_*; docs/fair-share.md)
-- KEYS[FIXED+1..] a checked call's (ARGV[8] 0) result key of each request, in ARGV's
--         order, which its duplicate check reads; a call that skips the check declares none
--         (it touches no result key: each id is sent once, in ARGV, not again in a key)
-- ARGV[1] result key prefix (an id with a result already is not enqueued again)
-- ARGV[2] default max_pending
-- ARGV[3] default max_request_bytes
-- ARGV[4] default class delays in ms, "realtime=0,normal=5000,batch=60000"
-- ARGV[5] client id whose reply list gets the results ('' for none)
-- ARGV[6] default memory_high_water: refuse new requests once Redis' used_memory is
--         over this fraction of its maxmemory (0, or no maxmemory: no check)
-- ARGV[7] the shard count the caller routed by (QueueSettings.shards as it read them)
-- ARGV[8] 1: every id was made by the calling client and none was in a call before
--         (batching/request.py first_send): none can be known, so the duplicate check
--         (a read of each result key and of `requests`: a sixth of an enqueue) is skipped;
--         ids repeated within the call are still accepted once. 0: checked.
-- ARGV[9..] runs of requests that share a priority (class name or integer seconds), a
--           deadline in ms from now (0 = none) and a tenant: those three, the run's
--           count k, then k triples: id, tokens ("~N": an estimate), request JSON
--           (batching/calls.py enqueue_call: one run for a Client.map call's requests)
-- Returns {1, now_ms, "s1..sN"}, one text of a digit a request: si = 1 accepted, 0 already
--         known (idempotent; an id repeated within the call is accepted once, with its
--         first payload). One text, not a value each: a value of a script's reply costs
--         Redis about four times its bytes joined in one;
--      or {0, code, index, detail}: code 'full' (detail: max_pending),
--         'too_large' (detail: max_request_bytes), 'priority' (detail: the class),
--         'memory' (detail: "used_memory/maxmemory"), 'tenant_full' (index: the first
--         request of a tenant over its tenant_max_pending, detail: that limit, then the
--         shard count), 'shards' (detail: the shard
--         count stored here, which the caller's ARGV[7] differs from: route again);
--         nothing is written then. 'full' gives the shard count as its index: each
--         shard holds at most ceil(max_pending / shards).
-- Idempotent: a call that accepted ids remembers its reply under K.call for 60 s; the
-- same call again (the connection retried after a lost reply) gets that reply back (its
-- values as texts: {'1', now, statuses}), its ids accepted (1), not "already known".
local remembered = remembered_reply(K.call)
if remembered then return remembered end
local result_prefix, client = ARGV[1], ARGV[5]
local shards = setting(K.settings, 'shards', 1)
if shards ~= tonumber(ARGV[7]) then return {0, 'shards', 0, shards} end
local max_total = setting(K.settings, 'max_pending', tonumber(ARGV[2]))
local max_pending = math.ceil(max_total / shards)  -- this shard's share
local max_bytes = setting(K.settings, 'max_request_bytes', tonumber(ARGV[3]))

local default_delays = {}
for class, ms in string.gmatch(ARGV[4], '([^,=]+)=(%d+)') do default_delays[class] = tonumber(ms) end
local delays = {}
-- One rule with batching/settings.py CLASS_NAME: digits alone are a delay in seconds,
-- anything else a class name (never tonumber(): it reads 'inf' and 'nan' as numbers).
local function delay_of(priority)
  if string.match(priority, '^%d+$') then return tonumber(priority) * 1000, nil end
  if delays[priority] == nil then
    local v = rcall('HGET', K.settings, 'delay:' .. priority)
    delays[priority] = v and math.floor(tonumber(v) * 1000) or default_delays[priority] or false
  end
  return delays[priority], priority
end
-- an integer priority is reported under the slowest class it is at least as urgent as
local function class_of(delay)
  local best, best_delay = 'realtime', -1
  for _, class in ipairs({'realtime', 'normal', 'batch'}) do
    local d = delay_of(class)
    if d and d <= delay and d > best_delay then best, best_delay = class, d end
  end
  return best
end

-- Bytes a request costs Redis besides its payload: its entries in pending, sched,
-- requests and depth (about 360 B measured by `python -m bench.memory arithmetic`).
local REQUEST_OVERHEAD = 400
-- INFO memory costs more than the rest of a small call: a Redis found without maxmemory
-- (no mark to pass) is asked again after a second, not at every call; the time is kept in
-- the settings hash (a maxmemory set at run time applies within that second).
local UNLIMITED_FOR_MS = 1000
local UNLIMITED_UNTIL = 'memory_unlimited_until_ms'  -- not a setting: no QueueSettings field
-- "used/max" when accepting `incoming` more bytes would pass the high-water mark.
local function over_high_water(incoming, now)
  local fraction = setting(K.settings, 'memory_high_water', tonumber(ARGV[6]))
  if not fraction or fraction <= 0 then return nil end
  if now < (tonumber(rcall('HGET', K.settings, UNLIMITED_UNTIL) or '0') or 0) then return nil end
  local info = rcall('INFO', 'memory')
  local used = tonumber(string.match(info, 'used_memory:(%d+)'))
  local max = tonumber(string.match(info, 'maxmemory:(%d+)'))
  if not max or max == 0 then
    rcall('HSET', K.settings, UNLIMITED_UNTIL, fmt_int(now + UNLIMITED_FOR_MS))
  elseif used + incoming > fraction * max then
    return used .. '/' .. max
  end
  return nil
end

-- Every entry is checked before anything is written: a refusal leaves no trace.
-- The runs: {priority, deadline, tenant, ARGV index of its first id, count}.
local runs, n, n_args = {}, 0, #ARGV
do
  local a = 9
  while a <= n_args do
    local k = tonumber(ARGV[a + 3])
    runs[#runs + 1] = {ARGV[a], ARGV[a + 1], ARGV[a + 2], a + 4, k}
    n, a = n + k, a + 4 + 3 * k
  end
end
-- A dead letter whose dead result is gone (expired, or written to a job's output) no
-- longer blocks its id: its leftovers are dropped and the id runs afresh.
-- Two reads for the whole call, not two per request: how many have a result (none, on a
-- fresh call: then no result key is read again) and which are held in `requests`.
local status, fresh, incoming, seen, stale = {}, 0, 0, {}, {}
local checked = n > 0 and ARGV[8] ~= '1'
local ids = {}  -- in ARGV's order
do
  local i = 0
  for _, run in ipairs(runs) do
    for a = run[4], run[4] + 3 * (run[5] - 1), 3 do i = i + 1; ids[i] = ARGV[a] end
  end
end
if checked and (#KEYS ~= FIXED + n or KEYS[FIXED + 1] ~= result_prefix .. ids[1]
                or KEYS[FIXED + n] ~= result_prefix .. ids[n]) then
  error('batchery: enqueue needs the result key of each id in KEYS, in ARGV order')
end
local some_results = checked and count_existing(KEYS, FIXED + 1, FIXED + n) > 0
local held = checked and hmget_chunked(K.requests, ids) or {}
local function known(i, id)
  if seen[id] or (some_results and rcall('EXISTS', KEYS[FIXED + i]) == 1) then return true end
  if not held[i] then return false end
  if rcall('ZSCORE', K.dead, id) then
    stale[#stale + 1] = id
    return false
  end
  return true
end
local by_tenant, first_of = {}, {}  -- fresh requests per tenant; its first index
local i = 0
for _, run in ipairs(runs) do
  local priority, tenant, a = run[1], run[3], run[4]
  local valid, run_fresh = delay_of(priority), 0
  for _ = 1, run[5] do
    i = i + 1
    local id, payload = ids[i], ARGV[a + 2]
    if (seen[id] or some_results or held[i]) and known(i, id) then  -- (a call only then)
      status[i] = '0'  -- known already, or earlier in this call: the first one stands
    else
      seen[id] = true
      if #payload > max_bytes then return {0, 'too_large', i, max_bytes} end
      if not valid then return {0, 'priority', i, priority} end
      status[i] = '1'
      run_fresh = run_fresh + 1
      first_of[tenant] = first_of[tenant] or i
      incoming = incoming + #payload + #id + REQUEST_OVERHEAD
    end
    a = a + 3
  end
  if run_fresh > 0 then
    fresh = fresh + run_fresh
    by_tenant[tenant] = (by_tenant[tenant] or 0) + run_fresh
  end
end
local queued = fresh > 0 and rcall('ZCARD', K.pending) or 0
if fresh > 0 and queued + rcall('ZCARD', K.delayed) + fresh > max_pending then
  return {0, 'full', shards, max_total}
end
-- a tenant over its own limit is refused, all or nothing; other tenants are not affected
for tenant, more in pairs(by_tenant) do
  local most = tonumber(rcall('HGET', K.settings, 'tenant_max_pending:' .. tenant) or '0') or 0
  if most > 0 and tonumber(rcall('HGET', K.depth, TENANT_DEPTH .. tenant) or '0') + more
                  > math.ceil(most / shards) then
    return {0, 'tenant_full', first_of[tenant], most, shards}
  end
end
local now = now_ms()
if fresh > 0 then
  local memory = over_high_water(incoming, now)
  if memory then return {0, 'memory', 0, memory} end
end

local now_s = fmt_int(now)
-- what one priority writes, formatted once per call: its rank, the tail of its sched
-- entry (":enqueued_ms:rank:class:client") and its class
local by_priority = {}
local function written(priority)
  local w = by_priority[priority]
  if not w then
    local delay, class = delay_of(priority)
    class = class or class_of(delay)
    local rank = fmt_int(now + delay)
    w = {rank = rank, tail = table.concat({'', now_s, rank, class, client}, ':'), class = class}
    by_priority[priority] = w
  end
  return w
end
-- what one (priority, tenant) writes besides the id, built once per call: the tail of its
-- sched entry, the head of its fair-share member; and how many it adds
local by_group = {}
local function group_of(priority, tenant)
  local key = priority .. '\t' .. tenant
  local g = by_group[key]
  if not g then
    local w = written(priority)
    g = {w = w, tenant = tenant, n = 0, sched_tail = w.tail .. ':' .. tenant,
         member_head = fair_member(w.class, tenant, tonumber(w.rank), '')}
    by_group[key] = g
  end
  return g
end
-- listed in sub-queues too, unless they are the sole tenant's (_common.lua FAIR_MODE)
local one_tenant, n_tenants = nil, 0
for tenant in pairs(by_tenant) do one_tenant, n_tenants = tenant, n_tenants + 1 end
local listed = fresh > 0 and fair_listing(K, n_tenants == 1 and one_tenant, queued == 0)
local zargs, hargs, sargs, fargs, counts, m = {}, {}, {}, {}, {}, 0
i = 0
for _, run in ipairs(runs) do
  local g, deadline, a = group_of(run[1], run[3]), run[2], run[4]
  local expire = deadline ~= '0' and tonumber(deadline) > 0 and fmt_int(now + tonumber(deadline)) or '0'
  local rank, tail, head = g.w.rank, ':' .. expire .. g.sched_tail, g.member_head
  for _ = 1, run[5] do
    i = i + 1
    if status[i] == '1' then
      local id = ids[i]
      zargs[m + 1], zargs[m + 2] = rank, id
      hargs[m + 1], hargs[m + 2] = id, ARGV[a + 2]
      sargs[m + 1], sargs[m + 2] = id, ARGV[a + 1] .. tail
      if listed then fargs[m + 1], fargs[m + 2] = '0', head .. id end
      m = m + 2
      g.n = g.n + 1
    end
    a = a + 3
  end
end
local joined = {}
for _, g in pairs(by_group) do
  joined[g.w.class .. '\t' .. g.tenant] = {g.w.class, g.tenant}
  count_queued(counts, g.w.class, g.tenant, g.n)
end
if fresh > 0 then
  if #stale > 0 then
    call_chunked('ZREM', K.dead, stale)
    call_chunked('HDEL', K.attempts, stale)
    call_chunked('HDEL', K.history, stale)
  end
  -- nothing queued: the per-request keys start again, in their wide encodings
  local wide = {{K.requests, K.sched}, listed and {K.pending, K.fair} or {K.pending}}
  if queued == 0 then widen(true, wide[1], wide[2]) end
  call_chunked('ZADD', K.pending, zargs)
  call_chunked('HSET', K.requests, hargs)
  call_chunked('HSET', K.sched, sargs)
  if listed then call_chunked('ZADD', K.fair, fargs) end
  for _, pair in pairs(joined) do fair_join(K, pair[1], pair[2]) end
  add_depth(K.depth, counts)
  if queued == 0 then widen(false, wide[1], wide[2]) end
  rcall('HINCRBY', K.stats, 'enqueued', fresh)
  rcall('RPUSH', K.wake, 1)
  rcall('LTRIM', K.wake, -64, -1)
end
local reply = {1, now, table.concat(status)}
if fresh > 0 then remember_reply(K.call, reply) end
return reply
