-- claim: lease the next batch to a worker (the rule of batching/policy.py select_batch).
-- K.pending    ZSET id -> rank
-- K.delayed    ZSET id -> ms it may run again
-- K.sched      HASH id -> "tokens:expire_ms:enqueued_ms:rank:class:client"
-- K.attempts   HASH id -> failed runs
-- K.lease_ids  HASH lease token -> the ids its claim holds   K.lease_expiry  ZSET token ->
--              ms its lease lapses (_common.lua lease_read)
-- K.settings   HASH
-- K.depth      HASH class -> queued count
-- K.claim     STRING this token's claim remembered: its wait, head rank and ids (below)
-- K.fair  K.fair_tenants  K.vtc   the tenants' sub-queues and
--          counters (_common.lua fair_*)   K.served  HASH tenant -> tokens claimed
-- K.rates  HASH tenant -> "level:ms": the token bucket of a tenant with a token rate
-- K.plan   STRING the next batches one read of the lookahead chose ("planned", below)
-- ARGV[1] lease token of this claim (worker id + claim number)
-- ARGV[2] max_batch_size   ARGV[3] max_batch_tokens (padded)   ARGV[4] max_wait_ms
-- ARGV[5] lookahead (how many of the most urgent requests to choose from, at most: the
--         claim stops at a batch's worth when those settle the batch, see below)
-- ARGV[6] default lease_seconds
-- ARGV[7] 1: this worker counts tokens exactly, so estimated candidates are handed to it
--         to price before any batch is chosen; 0: choose on estimates
-- ARGV[8] rank ceiling: lease nothing ranked above it ('' none). A sharded queue's
--         claimer passes the next shard's head rank + SHARD_SLACK_MS (batching/sharded.py)
--         so no shard's head is overtaken by much later requests of another (save by
--         the fair claim's tenants of the head's class: fair_reader).
-- ARGV[9] ids and ARGV[10] their exact tokens (0 for one not counted), in the same order,
--         each one MessagePack array (batching/claim_call.py packed_array): this worker's
--         counts of the candidates an earlier claim handed it to price. The claim chooses
--         on them, and writes to sched those of the ones it does not take, still marked
--         estimated (the ones it leases are counted again by their worker, and again if
--         they come back for a retry). Two values, not two per request: a value handed to
--         a script costs Redis more than a command's argument (each is made a Lua string,
--         and collected), and an array unpacked in one call (cmsgpack) less than a text
--         split by a pattern, which runs per character; ids that are the candidates' own,
--         in line (a worker's next batch, as a claim handed it ahead), are matched to them
--         by place, not looked up one by one (below).
-- ARGV[11] the batches this claim may lease: 2 from a worker that runs a claim's batches
--         in turn (each under its own lease: below, "a deep queue's next batch"); 1 (or
--         none, a worker from before) one batch
-- Returns {now_ms, wait_ms, n_expired, head_rank, ids, scheds, {attempts}, ahead_ids,
--   n_next} when it leased something: n_next, the last ids' count, leased under the token
--   ARGV[1] .. '+' (a second batch: 0 for none), the rest under ARGV[1]; ids, scheds
--   (each id's entry, '' for one without a readable
--   entry) and ahead_ids each one text, joined by newlines (reply_for); {attempts} an
--   array, empty when no request has failed. The requests' payloads are not in it: the caller reads them
--   after, with one plain HMGET of `requests` for the ids and the ahead ids (a request
--   leased stays held; one handed ahead may be gone by then, and is left out). A value
--   read by a script is made a Lua string and written out again: it costs Redis about
--   three times a plain read's (docs/scaling.md). head_rank: the
--   rank of the most urgent pending request when the batch was chosen (a request ranked
--   before it later is more urgent than anything then). ahead: with ARGV[7] = 1,
--   requests next in line to count (the next batch's candidates, when this batch's were
--   estimated: see "priced ahead" below), handed to the worker to count while this batch
--   runs and to send with its next claim, which then needs no pricing round (a round trip
--   per batch saved). The first n_expired ids are past their deadline (leased so the
--   worker records them as expired; never run). wait_ms > 0: the head is held that
--   much longer, or the earliest retry is due in that many ms (nothing else claimed);
--   wait_ms = -1: nothing is pending or waiting to be retried. A paused queue answers
--   {now_ms, PAUSED_WAIT_MS, 0}: nothing claimed, ask again later.
--   wait_ms = -2: nothing claimed; {now_ms, -2, 0, "id\nid..."}: the candidates priced by
--   estimate (their payloads read by the caller, as above): count them, claim again with
--   the counts.
-- Fair share (docs/fair-share.md): the class of the most urgent pending request is
-- served. When two or more of its tenants are backlogged, the batch's head is the first
-- of the least served tenant's sub-queue and the candidates are that tenant's, then the
-- next ones' by counter (those within max_batch_tokens of the least: the bound), read
-- the same lazy way; else the candidates are the global lookahead as before. Either way
-- each claimed request's tokens / its tenant's weight are added to the tenant's counter.
-- Idempotent: a claim that leased something remembers its ids under K.claim for the
-- lease time; the same token again (the connection retried after a lost reply) gets
-- the same batch back, less what it no longer holds, and leases nothing new.
local token = ARGV[1]
local next_token = token .. '+'  -- the lease of a deep queue's next batch (below)
local max_size, max_tokens = tonumber(ARGV[2]), tonumber(ARGV[3])
local max_wait, lookahead = tonumber(ARGV[4]), tonumber(ARGV[5])
local price_estimates = ARGV[7] == '1'
local ceiling = ARGV[8] ~= '' and ARGV[8] or nil
-- The counts sent: sent_ids the ids, count_at[n] the n-th one's count as text, false when
-- it is not a count (checked once per distinct value, by parse_sched's rule: a positive
-- integer of at most 8 digits). Unpacked before anything is written: what is not two
-- arrays of one length is refused.
local sent_ids, count_at, n_counts = {}, {}, 0
do
  local ids_ok, counts_ok, counts
  ids_ok, sent_ids = pcall(cmsgpack.unpack, ARGV[9] or '')
  counts_ok, counts = pcall(cmsgpack.unpack, ARGV[10] or '')
  if not (ids_ok and counts_ok) or type(sent_ids) ~= 'table' or type(counts) ~= 'table'
     or #sent_ids ~= #counts then
    error('batchery: claim needs the ids counted and one count each, as two MessagePack arrays')
  end
  n_counts = #sent_ids
  local text_of = {}
  for n = 1, n_counts do
    local c = counts[n]
    local key = c == c and c or 0  -- (a table key: not nil, not NaN)
    local text = text_of[key]
    if text == nil then
      text = type(c) == 'number' and c >= 1 and c <= 99999999 and c % 1 == 0 and fmt_int(c)
             or false
      text_of[key] = text
    end
    count_at[n] = text
  end
end
-- counted: id -> its count, counted_ids: those ids in order (an id's first count). Built
-- from the ids sent only when they are not the candidates' own, in line (`in_line`, set
-- once the candidates are read), or when some counted candidate is left queued.
local counted, counted_ids, in_line = {}, {}, false
local function counted_by_id(ids)
  counted, counted_ids = {}, {}
  local n = 0
  if in_line then
    for i = 1, n_counts do
      if count_at[i] then counted[ids[i]] = count_at[i]; n = n + 1; counted_ids[n] = ids[i] end
    end
    return
  end
  for i = 1, n_counts do
    local id, tokens = sent_ids[i], count_at[i]
    if tokens and type(id) == 'string' and not counted[id] then  -- first count of an id
      counted[id] = tokens
      n = n + 1
      counted_ids[n] = id
    end
  end
end
local now = now_ms()

-- Token rate limits (settings tenant_token_rate:NAME, docs/fair-share.md): a tenant's
-- bucket holds at most RATE_BURST_S of its rate (a shard's rate: rate / shards), refills
-- at it and is charged the tokens each claim serves the tenant; while it is empty (at or
-- below 0: one claim may take it below) the tenant's requests are passed over, nobody
-- else's. limited(tenant) reads a tenant's bucket once per claim; refill_ms: the
-- soonest a passed-over tenant's bucket is above 0 again.
local RATE_BURST_S = 1  -- a second's worth: a burst of one batch or so, no saved-up flood
local rated = setting(K.settings, 'tenant_rates', 0) ~= 0
local rate_of, level_of, refill_ms = {}, {}, nil
local function limited(tenant)
  if not rated then return false end
  if level_of[tenant] == nil then
    local rate = tonumber(rcall('HGET', K.settings, 'tenant_token_rate:' .. tenant) or '0') or 0
    rate = rate / math.max(1, tonumber(setting(K.settings, 'shards', 1)) or 1)
    level_of[tenant], rate_of[tenant] = false, rate
    if rate > 0 then
      local level, at = string.match(rcall('HGET', K.rates, tenant) or '', '^(-?[%d.]+):(%d+)$')
      level_of[tenant] = math.min(rate * RATE_BURST_S,
        level and tonumber(level) + rate * (now - tonumber(at)) / 1000 or rate * RATE_BURST_S)
    end
  end
  local level = level_of[tenant]
  if not level or level > 0 then return false end
  local ms = math.floor(-level / rate_of[tenant] * 1000) + 1
  refill_ms = math.min(refill_ms or ms, ms)
  return true
end
-- Charge a rate-limited tenant's bucket the tokens a claim served it.
local function rate_charge(tenant, tokens)
  if rated and not limited(tenant) and level_of[tenant] then
    rcall('HSET', K.rates, tenant, string.format('%.3f:%d', level_of[tenant] - tokens, now))
  end
end

-- The reply: {now, wait, n_expired, head_rank, ids, scheds, attempts, ahead ids} for
-- out_ids, the expired ones first; scheds: their entries ('' for one handed over without
-- it), the caller's own when it holds them already (`ids`: out_ids joined, when built).
-- The ids, the entries and the ahead ids are one text each, joined by newlines (ids and
-- entries hold none: batching/request.py check_name, read_entry): a value of a script's
-- reply costs Redis several times its bytes joined into one, some 1.2k instructions
-- each. attempts stays an array (false: none), read only when some request has failed
-- (HLEN, once per claim; else {}). No payload: the caller reads them with a plain HMGET
-- (the header).
local function reply_for(wait, out_ids, n_expired, scheds, head_rank, n_next, ahead, ids)
  if #out_ids == 0 then return {now, wait, 0} end
  local failed = rcall('HLEN', K.attempts) > 0
  return {now, wait, n_expired, head_rank or 0, ids or table.concat(out_ids, '\n'),
          table.concat(scheds, '\n'),
          failed and rcall('HMGET', K.attempts, unpack(out_ids)) or {},
          table.concat(ahead or {}, '\n'), n_next}
end

-- A candidate's entry split off its tail (_common.lua split_entry), each distinct tail
-- matched once per claim. read_entry(raw): {estimated, tokens text, tail, the
-- tail's fields}, the tail's fields {expire ms, enqueued ms, class delay ms, the exact
-- entries built from it by count}; NOT_AN_ENTRY (no fields) for what cannot be read.
local NOT_AN_ENTRY = {}
local entry_of, tail_of = {}, {}
local count_of = {}  -- tokens text -> its number, converted once per distinct text
local function count_in(tokens)
  local c = count_of[tokens]
  if not c then c = tonumber(tokens); count_of[tokens] = c end
  return c
end
local function read_entry(raw)
  local tokens, is_estimated, tail = split_entry(raw)
  local e = NOT_AN_ENTRY
  if tokens then
    local t = tail_of[tail]
    if t == nil then  -- the tail read once, by the one rule (parse_sched); none holds a
      -- newline, so the reply can join the entries by them (reply_for)
      local s = parse_sched('0' .. tail)
      t = not s.unreadable and not string.find(tail, '\n', 1, true)
          and {s.expire, s.enq, s.rank - s.enq, {}, s} or false
      tail_of[tail] = t
    end
    if t then e = {is_estimated, tokens, tail, t} end
  end
  entry_of[raw] = e
  return e
end

-- Write the counts of the counted candidates not taken (still in `counted`) to sched,
-- where their entry is still marked estimated ("~N").
local function write_counts()
  local rest_ids = {}
  for _, id in ipairs(counted_ids) do
    if counted[id] then rest_ids[#rest_ids + 1] = id end
  end
  if #rest_ids == 0 then return end
  local raws, writes, w = hmget_chunked(K.sched, rest_ids), {}, 0
  for n, id in ipairs(rest_ids) do
    local e = raws[n] and (entry_of[raws[n]] or read_entry(raws[n])) or NOT_AN_ENTRY
    if e[1] then  -- still estimated
      writes[w + 1], writes[w + 2] = id, counted[id] .. e[3]
      w = w + 2
    end
  end
  call_chunked('HSET', K.sched, writes)
end

-- A remembered claim's reply: the ids of its batches still leased to this token and to
-- next_token (the first n_expired of them expired, the next n_unreadable handed over
-- without their entry, the last n_next those of the next batch).
local function leased_reply(wait, ids, n_expired, n_unreadable, n_next, head_rank)
  local out_ids, n_out_expired, n_out_next, unreadable_at = {}, 0, 0, {}
  local _, held = lease_read(K, token)
  local _, held_next = lease_read(K, next_token)
  local first_next = #ids - n_next + 1
  for i, id in ipairs(ids) do
    if (i < first_next and held or held_next)[id] then
      out_ids[#out_ids + 1] = id
      if i <= n_expired then n_out_expired = n_out_expired + 1
      elseif i <= n_expired + n_unreadable then unreadable_at[#out_ids] = true
      elseif i >= first_next then n_out_next = n_out_next + 1 end
    end
  end
  local scheds = #out_ids > 0 and rcall('HMGET', K.sched, unpack(out_ids)) or {}
  for n, raw in ipairs(scheds) do  -- (one damaged since: not readable now either)
    if unreadable_at[n] or not raw or not (entry_of[raw] or read_entry(raw))[4] then
      scheds[n] = ''
    end
  end
  return reply_for(wait, out_ids, n_out_expired, scheds, head_rank, n_out_next)
end

-- The remembered claim: "wait\nhead_rank\nn_expired\nn_unreadable\nn_next\nid\nid..." (ids
-- hold no control character: batching/request.py check_name), the expired ids first, then
-- the unreadable ones, the next batch's last.
local remembered = rcall('GET', K.claim)
if remembered then
  local fields = {}
  for v in string.gmatch(remembered, '[^\n]+') do fields[#fields + 1] = v end
  local ids = {}
  for i = 6, #fields do ids[i - 5] = fields[i] end
  return leased_reply(tonumber(fields[1]), ids, tonumber(fields[3]), tonumber(fields[4]),
                      tonumber(fields[5]), tonumber(fields[2]))
end

-- a paused queue (`batchery queue pause`) hands out nothing; enqueues go on
if setting(K.settings, 'paused', 0) ~= 0 then return {now, PAUSED_WAIT_MS, 0} end

fair_list_step(K)  -- while the queue is listing its backlog (_common.lua FAIR_MODE)

-- retries whose backoff is over go back to pending at their original rank
local due = rcall('ZRANGEBYSCORE', K.delayed, '-inf', now, 'LIMIT', 0, 1000)
if #due > 0 then
  local scheds = rcall('HMGET', K.sched, unpack(due))
  local zargs, back = {}, {}
  for i, id in ipairs(due) do  -- (one without a readable entry: at the current time, to be failed)
    local s = parse_sched(scheds[i] or '')
    zargs[2 * i - 1], zargs[2 * i] = s.unreadable and now or s.rank, id
    if not s.unreadable then back[#back + 1] = {id, s} end
  end
  call_chunked('ZADD', K.pending, zargs)
  call_chunked('ZREM', K.delayed, due)
  for _, entry in ipairs(back) do fair_push(K, entry[1], entry[2]) end
end

-- Candidates are read lazily: first as many as a batch holds. When those are all live,
-- as long as the head and no less urgent, no later candidate can displace one of them
-- (the closest length to the head wins, ties by rank), so the batch is theirs and the
-- rest of the lookahead is not read: a fixed-length or no-op workload reads each request
-- once, not lookahead / batch size times. Otherwise the claim reads on to `lookahead`.
-- (batching/policy.py settled_by states the same rule.)
-- The fair-share reader of class: its backlogged tenants within `quantum` of the least
-- served, each one's sub-queue in rank order, in counter order; nil when fewer than two
-- of them are backlogged or the global head is not in its sub-queue (it is served by
-- the global lookahead then, so no request is out of reach). The rank ceiling of a
-- sharded claim bounds the head (the class served), not the tenants read within its
-- class: each shard shares its class as one queue would, so the shards' sum is shared. r.read(count) gives the
-- next `count` ids still pending at their rank; the entries found stale (cancelled,
-- claimed as another id's, enqueued again) are listed in r.stale to drop.
local FAIR_TENANTS_READ = 64  -- tenants one claim may draw from: bounds its time
local function fair_reader(head)
  if not fair_mode(K).complete then return nil end  -- one tenant's work alone, or listing
  local raw = head and rcall('HGET', K.sched, head)
  if not raw then return nil end
  local s = parse_sched(raw)
  if not rcall('ZSCORE', K.fair, fair_member(s.class, s.tenant, s.rank, head)) then return nil end
  local backlog, open = fair_backlog(K, s.class, FAIR_TENANTS_READ), {}
  for _, t in ipairs(backlog) do  -- those over their token rate are passed over
    if not limited(t.tenant) then open[#open + 1] = t end
  end
  if #open < 2 and not (rated and #open == 1) then return nil end
  backlog = open
  local r = {class = s.class, i = 1, after = nil, stale = {}, tenants = {}}
  for _, t in ipairs(backlog) do
    if t.counter > backlog[1].counter + max_tokens then break end
    r.tenants[#r.tenants + 1] = t.tenant
  end
  function r.read(count)
    local out = {}
    while #out < count and r.i <= #r.tenants do
      local low, high = lex_range(r.class .. '\t' .. r.tenants[r.i])
      local entries = rcall('ZRANGE', K.fair, r.after and '(' .. r.after or low, high,
                            'BYLEX', 'LIMIT', 0, count - #out)
      local done = #entries < count - #out
      for _, m in ipairs(entries) do
        r.after = m
        local rank, id = string.match(m, '^[^\t]*\t[^\t]*\t(%d+)\t(.*)$')
        local score = rcall('ZSCORE', K.pending, id)
        if score and tonumber(score) == tonumber(rank) then out[#out + 1] = id
        else r.stale[#r.stale + 1] = {m, r.class, r.tenants[r.i]} end
      end
      if done then r.i, r.after = r.i + 1, nil end
    end
    return out
  end
  return r
end

-- Settle a claim in the fair-share state: the taken requests (taken_ids, their sched
-- entries taken_scheds; the first n_unserved of them expired, not served) leave
-- their sub-queues and the queued counts (`counts`, for add_depth); the served ones'
-- tokens are charged to their tenants at their weights, after each class's floor is
-- raised to its least backlogged counter; the stale entries ({member, class, tenant})
-- are dropped. Each tenant touched keeps its place in fair_tenants while it has work.
local function fair_settle(taken_ids, taken_scheds, n_unserved, stale, counts)
  local members, touched, served = {}, {}, {}
  local mode = fair_mode(K)  -- (not listed: no sub-queue to leave, the sole tenant's)
  local function touch(class, tenant, tokens)
    local key = class .. '\t' .. tenant
    local t = touched[key] or {class = class, tenant = tenant, tokens = 0}
    t.tokens = t.tokens + tokens
    touched[key] = t
  end
  for _, e in ipairs(stale) do
    members[#members + 1] = e[1]
    touch(e[2], e[3], 0)
  end
  local by_tail = {}  -- taken requests by their entry's tail (the requests of one call share it)
  local function group_of(raw)  -- (readable: taken)
    local e = entry_of[raw] or read_entry(raw)
    local g = by_tail[e[3]]
    if not g then
      local s = e[4][5]
      g = {s = s, head = fair_member(s.class, s.tenant, s.rank, ''), n = 0, served = 0}
      by_tail[e[3]] = g
    end
    return g, e
  end
  local m = #members
  if mode.listed then
    for i, id in ipairs(taken_ids) do members[m + i] = group_of(taken_scheds[i]).head .. id end
  end
  -- the served ones by runs of one entry text (those of one call with one count share
  -- one), each run charged once
  local function serve(raw, k)
    local g, e = group_of(raw)
    g.n, g.served = g.n + k, g.served + k * count_in(e[2])
  end
  local run_raw, run = nil, 0
  for i = n_unserved + 1, #taken_ids do
    local raw = taken_scheds[i]
    if raw ~= run_raw then
      if run > 0 then serve(run_raw, run) end
      run_raw, run = raw, 0
    end
    run = run + 1
  end
  if run > 0 then serve(run_raw, run) end
  for i = 1, n_unserved do
    local g = group_of(taken_scheds[i])
    g.n = g.n + 1
  end
  for _, g in pairs(by_tail) do
    local s, tokens = g.s, g.served
    count_queued(counts, s.class, s.tenant, -g.n)
    touch(s.class, s.tenant, tokens)
    served[s.tenant] = (served[s.tenant] or 0) + tokens
  end
  if #members > 0 then
    call_chunked('ZREM', K.fair, members)
    -- nothing listed is left: one tenant's work alone may be pending again (FAIR_MODE)
    if mode.complete and #rcall('ZRANGE', K.fair, 0, 0) == 0 then
      rcall('HDEL', K.vtc, FAIR_MODE)
    end
  end
  local floors = {}
  for _, t in pairs(touched) do
    if t.tokens > 0 and not floors[t.class] then
      floors[t.class] = true
      local floor_field = t.class .. '\t'
      local least = fair_start(K, t.class)
      if least > (tonumber(rcall('HGET', K.vtc, floor_field) or '0') or 0) then
        rcall('HSET', K.vtc, floor_field, counter_text(least))
      end
    end
  end
  for _, t in pairs(touched) do
    local weight = tonumber(rcall('HGET', K.settings, 'tenant_weight:' .. t.tenant) or '1') or 1
    fair_charge(K, t.class, t.tenant, t.tokens, weight > 0 and weight or 1, not mode.listed)
  end
  for tenant, tokens in pairs(served) do
    if tokens > 0 then
      rcall('HINCRBY', K.served, tenant, tokens)
      rate_charge(tenant, tokens)
    end
  end
end

-- `count` pending ids from `offset` on, in rank order, none ranked above the ceiling
-- (nor below start_rank, when the head's tenant is over its token rate: open_head)
local start_rank = nil
local function global_ids(offset, count)
  if ceiling or start_rank then
    return rcall('ZRANGEBYSCORE', K.pending, start_rank or '-inf', ceiling or '+inf',
                 'LIMIT', offset, count)
  end
  return rcall('ZRANGE', K.pending, offset, offset + count - 1)
end
-- The most urgent sub-queue head of a tenant not over its token rate (of each class's
-- FAIR_TENANTS_READ least served): (id, rank), or nil when every one is over its rate.
local function open_head()
  local best_id, best_rank, after = nil, nil, '-'
  while true do
    local first = rcall('ZRANGE', K.fair_tenants, after, '+', 'BYLEX', 'LIMIT', 0, 1)[1]
    if not first then return best_id, best_rank end
    local class = string.match(first, '^([^\t]*)')
    for _, t in ipairs(fair_backlog(K, class, FAIR_TENANTS_READ)) do
      if not limited(t.tenant) then
        local low, high = lex_range(class .. '\t' .. t.tenant)
        local m = rcall('ZRANGE', K.fair, low, high, 'BYLEX', 'LIMIT', 0, 1)[1]
        local rank, id = string.match(m or '', '^[^\t]*\t[^\t]*\t(%d+)\t(.*)$')
        rank = tonumber(rank)
        if rank and (not best_rank or rank < best_rank)
            and (not ceiling or rank <= tonumber(ceiling)) then
          best_id, best_rank = id, rank
        end
      end
    end
    after = '[' .. class .. '\n'  -- the next class (no class or tenant holds a newline)
  end
end
local head_id = global_ids(0, 1)[1]
local head_rank = head_id and tonumber(rcall('ZSCORE', K.pending, head_id)) or 0
local head_sched = rated and head_id and rcall('HGET', K.sched, head_id)
if head_sched and limited(parse_sched(head_sched).tenant) then
  head_id, start_rank = open_head()  -- the global lookahead starts there too
end
local fair = setting(K.settings, 'fair_share', 1) ~= 0 and fair_reader(head_id) or nil
local fill_from_slower = setting(K.settings, 'fill_from_slower', 1) ~= 0

-- Planned batches. With varied lengths a claim reads its whole lookahead (up to 1,024
-- candidates) to take one batch (64): each request was read about 16 times. So a claim
-- that read on chooses, from what it read, the next batches too (the same rule, each
-- headed by the most urgent of what remains: batching/policy.py planned_after), while
-- what remains holds at least half the lookahead, PLAN_BATCHES in all, and keeps them
-- in K.plan: "shape:mark\nid\tid...\nid\tid..." (mark '~': the candidates were priced by
-- estimate, so the claim after the plan hands ahead: below). The next claims take them in
-- turn instead of
-- reading, each only while its batch's head is the queue's head (nothing more urgent
-- came, none of them was taken or cancelled), with the claim's shape (size, tokens,
-- lookahead, fill_from_slower) and no fair share or token rate in play; a member no
-- longer pending (or over the ceiling) is left out. A claim that does not take the next
-- planned batch drops the plan. Padding stays within the rule's own noise (2 in 100 either
-- way by bench.plan_quality) for a quarter of the reads.
local PLAN_BATCHES = 4
local shape = table.concat({ARGV[2], ARGV[3], ARGV[5], fill_from_slower and '1' or '0'}, ':')
-- the plan's first line: its shape and mark ('~': its candidates were priced by estimate)
local function plan_line(estimated)
  return shape .. (estimated and ':~' or ':=')
end
local planned, planned_scheds, plan_rest = nil, nil, nil  -- the next planned batch's ids
-- and their entries, when this claim takes it; the batches after it
local plan_estimated = false  -- the plan's candidates were priced by estimate
do
  local text = rcall('GET', K.plan)
  if text and text ~= '' then
    local a = string.find(text, '\n', 1, true)
    local b = a and (string.find(text, '\n', a + 1, true) or #text + 1)
    local next_ids = {}
    if string.sub(text, 1, #shape + 1) == shape .. ':' then
      plan_estimated = string.byte(text, #shape + 2) == 126  -- '~'
      if b and not fair and not rated then
        for id in string.gmatch(string.sub(text, a + 1, b - 1), '[^\t]+') do
          next_ids[#next_ids + 1] = id
        end
      end
    end
    -- A member with a readable schedule entry is pending still, at the rank the entry
    -- holds: only a claim leases, and a claim that does not take the plan drops it; a
    -- cancel deletes the entry. One without (or with one damaged since) is looked up:
    -- cancelled (left out), or an orphan (pending: leased, to be failed alone). A planned
    -- head that expired since is leased as expired, and the next member heads the batch.
    if head_id and next_ids[1] == head_id then  -- (the head is pending, under the ceiling)
      local raws = rcall('HMGET', K.sched, unpack(next_ids))
      planned, planned_scheds = {}, {}
      for n, id in ipairs(next_ids) do
        local raw = raws[n]
        local t = raw and (entry_of[raw] or read_entry(raw))[4]
        local rank = t and t[5].rank or tonumber(rcall('ZSCORE', K.pending, id) or nil)
        local keep = rank ~= nil and (not ceiling or rank <= tonumber(ceiling))
        if keep then
          planned[#planned + 1] = id
          planned_scheds[#planned] = raw or false
        end
      end
      plan_rest = string.sub(text, b + 1)
    end
    if not planned then rcall('SET', K.plan, '', 'KEEPTTL') end
  end
end
-- the next `count` candidates (read in turn: `offset` is where the last read ended)
local function pending_ids(offset, count)
  if fair then return fair.read(count) end
  return global_ids(offset, count)
end
local window = math.min(max_size, lookahead)
-- A deep queue's next batch. What a claim costs Redis whatever it leases (the script's
-- call, its reads of the queue's state, the fair-share charge, the lease, its memory) is
-- about a third of a claim of 64 (docs/scaling.md), so a worker that runs a claim's
-- batches in turn (ARGV[11] 2) is leased the batch after its own too, under a lease of
-- its own (next_token: each batch is committed whole, as one), while more than the
-- lookahead's worth is pending past the two: below that depth the workers share what is
-- left a batch a claim. It is the batch the next claim would take: a batch's worth more
-- of alike candidates (read with the first), or the first one the rule plans
-- (chosen_after); none with a planned batch, fair share or token rates (a tenant's turn
-- is one batch). Its worker gives it back if something more urgent comes before it
-- runs, as any batch claimed ahead (workers/claiming.py).
local deep = ARGV[11] == '2' and not planned and not fair and not rated
             and #rcall('ZRANGE', K.pending, lookahead + 2 * window, lookahead + 2 * window) > 0
local first_read = deep and math.min(2 * window, lookahead) or window  -- what is read first
local ids = planned or pending_ids(0, first_read)
local stale = fair and fair.stale or {}
if fair and #ids == 0 then  -- nothing live within reach: the global lookahead serves
  fair = nil
  ids = pending_ids(0, window)
end
if #ids == 0 then
  fair_settle({}, {}, 0, stale, {})
  -- all above the ceiling (another shard's head came first since it was read): ask again
  if ceiling and #rcall('ZRANGE', K.pending, 0, 0) > 0 then return {now, 1, 0} end  -- (no ZCARD: the worker's ACL)
  if refill_ms then return {now, refill_ms, 0} end  -- all that is pending is over its rate
  local next_due = rcall('ZRANGE', K.delayed, 0, 0, 'WITHSCORES')
  if #next_due == 0 then return {now, -1, 0} end
  return {now, math.max(1, tonumber(next_due[2]) - now), 0}
end
-- a candidate's rank is its pending score, and is in its sched entry too: read there
local scheds = planned_scheds or rcall('HMGET', K.sched, unpack(ids))
-- the counts sent are the first candidates', in line, or are matched by id
in_line = n_counts > 0 and #ids >= n_counts
for i = 1, in_line and n_counts or 0 do
  if ids[i] ~= sent_ids[i] then in_line = false; break end
end
if n_counts > 0 and not in_line then counted_by_id() end

-- Choosing reads only each candidate's length, deadline and class delay (rank minus
-- enqueue time); the taken ones' class is read once taken. This loop is most of a
-- claim's time: lengths and delays are converted once per distinct text (requests
-- enqueued by one call share "enqueued:rank"), and a deadline only when there is one.
local expired, live, lengths, delays, unreadable, estimated = {}, {}, {}, {}, {}, {}
local n_expired, n_live, n_unreadable, n_estimated = 0, 0, 0, 0  -- (no # per candidate: a search)
local n_scheds, n_priced = 0, 0  -- candidates with an entry; of them, priced by estimate
local n_applied = 0  -- candidates whose count this worker sent (ARGV)
local head_enq = nil
local function scan(first)
  for i = first, #ids do
    local id, raw = ids[i], scheds[i]
    local e = raw and (entry_of[raw] or read_entry(raw)) or NOT_AN_ENTRY
    local t = e[4]
    if not t then
      -- no entry, or one that cannot be read: leased with the batch, its entry not handed
      -- over, so its worker fails it alone (a result, never a silent drop)
      n_unreadable = n_unreadable + 1
      unreadable[n_unreadable] = i
    else
      local is_estimated, tokens = e[1], e[2]
      n_scheds = n_scheds + 1
      if is_estimated then
        n_priced = n_priced + 1
        local count
        if in_line then count = i <= n_counts and count_at[i] else count = counted[id] end
        if count then  -- counted by this worker: exact from now on
          n_applied = n_applied + 1
          is_estimated, tokens = false, count
          local exact = t[4][count]  -- the entry with this count, built once per count and tail
          if not exact then exact = count .. e[3]; t[4][count] = exact end
          scheds[i] = exact
        end
      end
      if rated and limited(parse_sched(scheds[i]).tenant) then
        -- over its token rate: passed over
      elseif t[1] > 0 and t[1] <= now then
        n_expired = n_expired + 1
        expired[n_expired] = i
      else
        n_live = n_live + 1
        live[n_live] = i
        local length = count_of[tokens] or count_in(tokens)
        lengths[n_live], delays[n_live] = length, t[3]
        head_enq = head_enq or t[2]
        if is_estimated then n_estimated = n_estimated + 1; estimated[n_estimated] = id end
      end
    end
  end
end
scan(1)
-- alike: every candidate read is live, of the head's length and no less urgent; settled:
-- alike and a batch's worth of them (no later candidate could displace one)
local alike = n_live == #ids
for j = 2, n_live do
  if not alike then break end
  alike = lengths[j] == lengths[1] and delays[j] <= delays[1]
end
local settled = alike and n_live == first_read
if not settled and not planned and #ids == first_read and first_read < lookahead then
  local more = pending_ids(first_read, lookahead - first_read)
  stale = fair and fair.stale or stale
  if #more > 0 then
    local more_scheds = rcall('HMGET', K.sched, unpack(more))
    for n = 1, #more do ids[first_read + n], scheds[first_read + n] = more[n], more_scheds[n] end
    scan(first_read + 1)
  end
end
if price_estimates and n_estimated > 0 then
  if in_line then counted_by_id(ids) end
  write_counts()
  return {now, -2, 0, table.concat(estimated, '\n')}  -- (n_estimated > 0: not '')
end

-- The live candidates by length, built once (not when alike: below): of_length[l] the
-- ones of length l in rank order (.n of them), lens the lengths ascending, at[l] l's place
-- in lens.
local of_length, lens, n_lens, at = {}, {}, 0, {}
for j = 1, alike and 0 or n_live do
  local l = lengths[j]
  local list = of_length[l]
  if list then
    local n = list.n + 1
    list[n], list.n = j, n
  else
    n_lens = n_lens + 1
    lens[n_lens], of_length[l] = l, {j, n = 1}
  end
end
if n_lens > 1 then table.sort(lens) end
for x = 1, n_lens do at[lens[x]] = x end

-- choose(h, taken): the batch the rule chooses, headed by live candidate h, from the
-- live candidates not in `taken`: its indexes into `live` in rank order, and whether it
-- is full. Classes as urgent as the head's first (class delay no larger), then the rest
-- (unless the queue's fill_from_slower is 0), each by closest length to the head, ties by
-- rank: a walk out from the head's length over `lens`, both sides of one gap merged in
-- rank order, that stops once the batch is full: a batch's worth of candidates and the
-- lengths between, not every candidate, for each batch chosen.
local function choose(h, taken)
  local head, head_delay = lengths[h], delays[h]
  local chosen, n_chosen, longest, rejected = {h}, 1, head, false
  for pass = 1, fill_from_slower and 2 or 1 do
    local slower_pass = pass == 2
    local lo, hi = at[head], at[head] + 1
    while n_chosen < max_size and (lo >= 1 or hi <= n_lens) do
      local below = lo >= 1 and head - lens[lo] or nil
      local above = hi <= n_lens and lens[hi] - head or nil
      local a = below and (not above or below <= above) and of_length[lens[lo]] or nil
      local b = above and (not below or above <= below) and of_length[lens[hi]] or nil
      if a then lo = lo - 1 end
      if b then hi = hi + 1 end
      local x, y, na, nb = 1, 1, a and a.n or 0, b and b.n or 0
      while n_chosen < max_size and (x <= na or y <= nb) do  -- the two merged in rank order
        local j
        if y > nb or (x <= na and a[x] < b[y]) then j = a[x]; x = x + 1 else j = b[y]; y = y + 1 end
        if not taken[j] and j ~= h then
          if (delays[j] > head_delay) ~= slower_pass then
            -- (a slower one in the first pass: its turn is the second, or, without
            -- fill_from_slower, room left empty on purpose: run now, do not hold the head)
            if not fill_from_slower then rejected = true end
          else
            local l = lengths[j]
            local widest = l > longest and l or longest
            if widest * (n_chosen + 1) <= max_tokens then
              n_chosen = n_chosen + 1
              chosen[n_chosen] = j
              longest = widest
            else
              rejected = true
            end
          end
        end
      end
    end
  end
  for x = 2, n_chosen do  -- in rank order (sorted only when the walk took them out of it)
    if chosen[x] < chosen[x - 1] then table.sort(chosen); break end
  end
  return chosen, rejected or n_chosen >= max_size
end

-- The batch the rule chooses after the ones `taken` (n_taken live candidates), headed
-- by the most urgent live candidate left, while those left hold at least half the
-- lookahead: its indexes into `live`, marked taken; nil when too few are left or it would
-- not be full.
local function chosen_after(taken, n_taken)
  if 2 * (n_live - n_taken) < lookahead then return nil end
  local h = 1
  while taken[h] do h = h + 1 end
  local next_batch, full = choose(h, taken)
  if not full then return nil end
  for _, j in ipairs(next_batch) do taken[j] = true end
  return next_batch
end

-- The batch: chosen from every live candidate; a planned one is taken as it is, full
-- (chosen so when planned: its members fit, unless a count changed since). Then a deep
-- queue's next batch (above): its candidates' indexes in next_batch.
local batch, chosen, next_batch, taken = {}, nil, {}, {}
local wait = 0
if n_live > 0 then
  local full
  if alike then
    -- choose's walk would take them in rank order while they fit, the head always: the
    -- batch is the first k of them (alike candidates never read on: a batch's worth of
    -- them is settled)
    local k = math.min(n_live, max_size, math.max(1, math.floor(max_tokens / lengths[1])))
    chosen, full = {}, k >= max_size or k < n_live
    for j = 1, k do chosen[j] = j end
  else
    chosen, full = choose(1, {})
  end
  local waited = now - head_enq
  if not (full or planned) and waited < max_wait then
    wait, chosen = max_wait - waited, nil
  elseif alike then
    batch = chosen  -- (every candidate live: live[j] is j)
  else
    for n, j in ipairs(chosen) do batch[n] = live[j]; taken[j] = true end
  end
  local k = chosen and #chosen or 0
  if deep and full and chosen and alike and n_live >= 2 * k then
    -- the next k, alike to their own head too (a faster class among them heads it)
    for j = k + 1, 2 * k do
      if delays[j] > delays[k + 1] then next_batch = {}; break end
      next_batch[j - k] = j
    end
  elseif deep and full and chosen and not alike then
    for n, j in ipairs(chosen_after(taken, k) or {}) do next_batch[n] = live[j] end
  end
end
local n_next = #next_batch

-- The next batches, planned (above) by a claim that read on and leased a batch (and
-- maybe the next: PLAN_BATCHES in all): from the live candidates it did not take
-- (chosen_after), kept for lease_ms. Returns how many requests it planned.
local function plan_next(lease_ms)
  local plans, n_taken = {plan_line(n_priced > 0 or plan_estimated)}, #chosen + n_next
  local n_planned = 0
  while #plans + (n_next > 0 and 1 or 0) < PLAN_BATCHES do
    local planned_batch = chosen_after(taken, n_taken)
    if not planned_batch then break end
    local next_ids = {}
    for n, j in ipairs(planned_batch) do next_ids[n] = ids[live[j]] end
    plans[#plans + 1] = table.concat(next_ids, '\t')
    n_planned = n_planned + #next_ids
    n_taken = n_taken + #next_ids
  end
  if #plans > 1 then rcall('SET', K.plan, table.concat(plans, '\n'), 'PX', lease_ms) end
  return n_planned
end

-- the candidates taken, by index: the expired, the unreadable, the batch, the next batch
local take, n_take = batch, #batch
if n_expired + n_unreadable + n_next > 0 then
  take, n_take = {}, 0
  for _, list in ipairs({expired, unreadable, batch, next_batch}) do
    for _, i in ipairs(list) do n_take = n_take + 1; take[n_take] = i end
  end
end
if in_line and n_take < #ids then counted_by_id(ids) end  -- (else each was taken)
if n_applied == #counted_ids and n_take == #ids then
  counted = {}  -- every count was a candidate's, and every candidate is taken
elseif #counted_ids > 0 then
  for _, i in ipairs(take) do counted[ids[i]] = nil end  -- taken: counted again by its worker
  write_counts()
end
if n_take == 0 then
  fair_settle({}, {}, 0, stale, {})
  if wait == 0 and refill_ms then wait = refill_ms end  -- what is left is over its rate
  return {now, wait, 0}
end

local lease_ms = math.floor(setting(K.settings, 'lease_seconds', tonumber(ARGV[6])) * 1000)
local expiry = fmt_int(now + lease_ms)  -- one lease expiry for the batch, formatted once
local out_ids, out_scheds, counts = ids, scheds, {}
if not (alike and n_take == #ids) then  -- (else every candidate is taken, in order)
  out_ids, out_scheds = {}, {}
  for n, i in ipairs(take) do
    out_ids[n], out_scheds[n] = ids[i], scheds[i]
  end
end
if n_unreadable == 0 then
  fair_settle(out_ids, out_scheds, n_expired, stale, counts)
else  -- the unreadable ones (after the expired) go without their entries, and unsettled
  local settle_ids, settle_scheds, n_settle = {}, {}, 0
  for n, id in ipairs(out_ids) do
    if n > n_expired and n <= n_expired + n_unreadable then
      out_scheds[n] = ''
    else
      n_settle = n_settle + 1
      settle_ids[n_settle], settle_scheds[n_settle] = id, out_scheds[n]
    end
  end
  fair_settle(settle_ids, settle_scheds, n_expired, stale, counts)
end
call_chunked('ZREM', K.pending, out_ids)
-- the lease, one a batch: its ids and when it lapses. A lease this token holds already
-- (its claim's reply was lost, and its memory above lapsed or was evicted before this
-- retry) keeps what it holds: those come back when this one lapses, never dropped.
local leased
if n_next == 0 then
  leased = table.concat(out_ids, '\n')
  local earlier = rcall('HGET', K.lease_ids, token)
  rcall('HSET', K.lease_ids, token, earlier and earlier .. '\n' .. leased or leased)
  rcall('ZADD', K.lease_expiry, expiry, token)
else
  local n_first = #out_ids - n_next
  local texts = {table.concat(out_ids, '\n', 1, n_first), table.concat(out_ids, '\n', n_first + 1)}
  leased = texts[1] .. '\n' .. texts[2]
  local earlier = rcall('HMGET', K.lease_ids, token, next_token)
  for n = 1, 2 do
    if earlier[n] then texts[n] = earlier[n] .. '\n' .. texts[n] end
  end
  rcall('HSET', K.lease_ids, token, texts[1], next_token, texts[2])
  rcall('ZADD', K.lease_expiry, expiry, token, expiry, next_token)
end
add_depth(K.depth, counts)
rcall('SET', K.claim, table.concat({fmt_int(wait), fmt_int(head_rank), fmt_int(n_expired),
                                    fmt_int(n_unreadable), fmt_int(n_next), leased}, '\n'),
      'PX', lease_ms)
-- the plan: this claim took its next batch (the rest stays), or read on and plans
local read_on = not planned and not fair and not alike and #ids > window
local n_planned = 0
if planned then
  local first_line = plan_line(plan_estimated)
  rcall('SET', K.plan, plan_rest ~= '' and first_line .. '\n' .. plan_rest or first_line,
        'KEEPTTL')
elseif read_on and not rated and chosen then
  n_planned = plan_next(lease_ms)
end
-- A counting worker's next batch, priced ahead: the estimated ones among the candidates
-- its next claim will read and this one did not. A claim that read only a batch's worth
-- (alike lengths) is followed by one that reads the next batch's worth from the new head;
-- one that read on (varied lengths: up to the lookahead) by one that reads as far, so
-- past this one's end by as many as it took (and dropped), and those are the ones to
-- count: the others it read were exact already, or counted and written exact above. (The
-- fair reader reads on from where this claim stopped.) A candidate taken by another
-- worker in between costs nothing but its count's bytes; one still estimated when the
-- next claim comes gets the pricing round as before. What this claim's candidates were
-- says what the next ones likely are, so their entries are read only when that is in
-- doubt: none estimated (producers that count exactly), nothing is handed ahead; all
-- estimated (producers that estimate), the next ones as they stand, less the ones this
-- worker just counted; an exact one among them is counted again and its count ignored;
-- a mix, the estimated ones among them, by their entries. A claim that planned the next
-- batches is followed by those (exact: counted, or written exact above), then by one that
-- reads past this one's end by as many as it took and planned; a planned claim hands
-- nothing ahead.
local ahead, m = {}, 0
if price_estimates and (n_priced > 0 or plan_estimated) and not planned then
  local next_ids = read_on and global_ids(#ids - n_take, n_take + n_planned)
                   or pending_ids(0, first_read)
  local all_priced = n_priced == n_scheds
  if all_priced and next(counted) == nil then  -- (what was counted, this batch took)
    ahead = next_ids
  elseif all_priced then
    for _, id in ipairs(next_ids) do
      if not counted[id] then m = m + 1; ahead[m] = id end
    end
  elseif #next_ids > 0 then
    local next_scheds = rcall('HMGET', K.sched, unpack(next_ids))
    for n, id in ipairs(next_ids) do
      if next_scheds[n] and string.byte(next_scheds[n], 1) == 126 then m = m + 1; ahead[m] = id end  -- '~'
    end
  end
end
return reply_for(wait, out_ids, n_expired, out_scheds, head_rank, n_next, ahead, leased)
