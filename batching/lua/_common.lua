-- Shared helpers: each script is sent with those it names (batching/scripts.py helpers_for).
local rcall = redis.call

-- The script's fixed keys by name (K.pending...), and their count (FIXED): what a call
-- declares after them is KEYS[FIXED + 1..]. Their order is written once, in
-- batching/scripts.py FIXED_KEYS, which prepends `local K, FIXED = named_keys({...})`.
local function named_keys(names)
  local K = {}
  for i, name in ipairs(names) do K[name] = KEYS[i] end
  return K, #names
end

-- Milliseconds on the Redis clock: every process of a queue shares it, so ranks,
-- leases and deadlines agree across machines whatever their clocks say.
local function now_ms()
  local t = rcall('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Variadic commands in slices, below Lua's unpack() limit (about 8000 values).
local function call_chunked(cmd, key, args)
  local step = 1000
  for i = 1, #args, step do
    rcall(cmd, key, unpack(args, i, math.min(i + step - 1, #args)))
  end
end

-- HMGET in slices (see call_chunked): the values of `fields`, in order (false: none).
local function hmget_chunked(key, fields)
  local out, step = {}, 1000
  for i = 1, #fields, step do
    local values = rcall('HMGET', key, unpack(fields, i, math.min(i + step - 1, #fields)))
    for n = 1, #values do out[#out + 1] = values[n] end
  end
  return out
end

-- How many of keys[first..last] exist, in slices (see call_chunked).
local function count_existing(keys, first, last)
  local found, step = 0, 1000
  for i = first, last, step do
    found = found + rcall('EXISTS', unpack(keys, i, math.min(i + step - 1, last)))
  end
  return found
end

-- Redis keeps a small hash or sorted set as one flat list (a listpack: up to 512 hash
-- fields or 128 set members of at most 64 bytes, its defaults) and finds a member by
-- scanning it. A queue's per-request keys (requests, sched; pending, fair)
-- hold a few hundred entries while the workers keep up, so each request's reads and
-- writes there scanned hundreds of entries: about half of redis-server's time per request
-- (bench/redis_time.py). One value over the flat list's limit turns the key into a hash
-- table or skip list, which Redis keeps until the key is deleted: written when such a key
-- starts again (empty), before its first writes, and removed after them, within the same
-- script (no reader sees it; removed before any write, an empty key would be deleted).
local WIDE = '\1' .. string.rep('w', 64)  -- 65 bytes: over *-max-listpack-value's 64
-- widen(true, hashes, zsets) before the writes; widen(false, ...) after them
local function widen(on, hashes, zsets)
  for _, key in ipairs(hashes) do
    if on then rcall('HSET', key, WIDE, WIDE) else rcall('HDEL', key, WIDE) end
  end
  for _, key in ipairs(zsets) do
    if on then rcall('ZADD', key, 0, WIDE) else rcall('ZREM', key, WIDE) end
  end
end

-- The ids of a call's n requests, cut from their result keys KEYS[first..first+n-1], which
-- a keyed commit declares (an id is sent once, in its key: a value handed to a script is
-- made a Lua string, dearer than cutting it from the key). The keys' count and the ends
-- are checked to be the queue's result keys (keys may follow them: the reply lists).
local function ids_in_result_keys(result_prefix, first, n, script)
  local cut, last = #result_prefix, first + n - 1
  if #KEYS < last
     or (n > 0 and (string.sub(KEYS[first], 1, cut) ~= result_prefix
                    or string.sub(KEYS[last], 1, cut) ~= result_prefix)) then
    error('batchery: ' .. script .. ' needs the result key of each id in KEYS, in ARGV order')
  end
  local ids = {}
  for i = 1, n do ids[i] = string.sub(KEYS[first + i - 1], cut + 1) end
  return ids
end

-- A queue setting from its hash, else the default the caller passed.
local function setting(settings_key, name, default)
  local v = rcall('HGET', settings_key, name)
  if v then return tonumber(v) or v end
  return default
end

-- sched entry: "tokens:expire_ms:enqueued_ms:rank:class:client:tenant"; tokens is "~N"
-- while N is the producer's estimate (no tokenizer there), until a worker writes the
-- exact count. Entries written before tenants end at client: their tenant is 'default'.
-- The one rule of a readable entry: a count of at most 8 digits (MAX_TOKENS, 1e7, in
-- batching/request.py), times and rank of digits only, at most 15 of them, and a class.
-- An entry that breaks it (damaged in Redis) parses as `unreadable`: no class (counted
-- nowhere, in no sub-queue), rank 0 (requeue puts it back at the current time instead),
-- and a claim hands it to a worker to fail alone.
local DEFAULT_TENANT = 'default'
local function parse_sched(s)
  local mark, tokens, expire, enq, rank, class, client, tenant =
    string.match(s, '^(~?)(%d+):(%d+):(%d+):([^:]+):([^:]*):([^:]*):?(.*)$')
  if tenant == nil or tenant == '' then tenant = DEFAULT_TENANT end
  if not tokens or #tokens > 8 or #expire > 15 or #enq > 15 or #rank > 15
     or not string.find(rank, '^%d+$') or class == '' then
    return {tokens = 0, estimated = false, expire = 0, enq = 0, rank = 0, class = '',
            client = client or '', tenant = tenant, unreadable = true}
  end
  return {tokens = tonumber(tokens), estimated = mark == '~', expire = tonumber(expire),
          enq = tonumber(enq), rank = tonumber(rank), class = class, client = client,
          tenant = tenant}
end

-- A sched entry split where the requests of one enqueue call part ways: its tokens text
-- (digits, no '~'), whether they are estimated, and the tail they share (":expire:...:
-- tenant", read once per distinct tail as parse_sched('0' .. tail)); nil when the tokens
-- break parse_sched's rule. With varied lengths nearly every entry differs, and a
-- pattern match of the whole costs more than the rest of reading it.
local function split_entry(raw)
  local colon = string.find(raw, ':', 1, true)
  local estimated = string.byte(raw, 1) == 126  -- '~'
  local tokens = colon and string.sub(raw, estimated and 2 or 1, colon - 1)
  if tokens and #tokens <= 8 and string.find(tokens, '^%d+$') then
    return tokens, estimated, string.sub(raw, colon)
  end
  return nil
end

-- How long a worker waits before asking a paused queue again (an enqueue wakes it sooner).
local PAUSED_WAIT_MS = 1000

local function fmt_int(x)
  return string.format('%d', x)
end

-- How long enqueue, fail and complete remember their reply under their call key (Keys.call): the
-- connection's retries after a lost reply give up within about 10 s.
local CALL_MEMORY_S = 60

-- The reply of an earlier run of this call (a retry after a lost reply), or nil: its
-- values as texts of digits (the callers read integers and digits alike).
local function remembered_reply(call_key)
  local saved = rcall('GET', call_key)
  if not saved then return nil end
  local reply = {}
  for v in string.gmatch(saved, '[^,]+') do reply[#reply + 1] = v end
  return reply
end

-- Keep `reply` (a list of integers and texts of digits, none empty) so that this call
-- retried gets it again. (a request's status is one digit: written from this table, not
-- formatted per request)
local DIGITS = {[0] = '0', '1', '2', '3', '4', '5', '6', '7', '8', '9'}
local function remember_reply(call_key, reply)
  local parts = {}
  for i, v in ipairs(reply) do parts[i] = DIGITS[v] or type(v) == 'string' and v or fmt_int(v) end
  rcall('SET', call_key, table.concat(parts, ','), 'EX', CALL_MEMORY_S)
  return reply
end

-- Queued requests (pending + delayed) per tenant are kept in the depth hash beside the
-- classes, under TENANT_DEPTH .. tenant (a class name never holds ':'): what
-- tenant_max_pending is checked against at enqueue.
local TENANT_DEPTH = 'tenant:'

-- Count n more queued requests of class and tenant in `counts`, for add_depth.
local function count_queued(counts, class, tenant, n)
  if class == '' then return end  -- an unreadable entry's: counted nowhere
  counts[class] = (counts[class] or 0) + n
  local field = TENANT_DEPTH .. tenant
  counts[field] = (counts[field] or 0) + n
end

-- Counts per priority class (and per tenant), applied with one HINCRBY each; a tenant
-- with nothing queued leaves the hash (a million job ids do not stay in it).
local function add_depth(depth_key, counts)
  for field, n in pairs(counts) do
    if n ~= 0 then
      local now = rcall('HINCRBY', depth_key, field, n)
      if now <= 0 and string.sub(field, 1, #TENANT_DEPTH) == TENANT_DEPTH then
        rcall('HDEL', depth_key, field)
      end
    end
  end
end

-- Fair share between the tenants of a class (docs/fair-share.md). Three keys, K.fair,
-- K.fair_tenants and K.vtc (batching/keys.py), all read by lex range or by field:
--   fair:         "class\ttenant\trank\tid": each (class, tenant)'s sub-queue in rank order
--   fair_tenants: "class\tcounter\ttenant": each class's backlogged tenants, least served
--                 first (the counter is weighted tokens served, zero-padded)
--   vtc:          "class\ttenant" -> counter; "class\t" -> the class's floor
-- Tenants and ids hold no control character (messages.py check_name), classes no tab.
local function fair_member(class, tenant, rank, id)
  return class .. '\t' .. tenant .. '\t' .. string.format('%015d', rank) .. '\t' .. id
end

local function counter_text(c)
  return string.format('%017.3f', c)
end

local function tenant_member(class, counter, tenant)
  return class .. '\t' .. counter_text(counter) .. '\t' .. tenant
end

-- The lex range of one class's entries in fair_tenants, or one sub-queue's in fair.
local function lex_range(prefix)
  return '[' .. prefix .. '\t', '(' .. prefix .. '\n'
end

-- The backlogged tenants of class, least served first: {tenant, counter} each, at most n.
local function fair_backlog(K, class, n)
  local low, high = lex_range(class)
  local out = {}
  for _, m in ipairs(rcall('ZRANGE', K.fair_tenants, low, high, 'BYLEX', 'LIMIT', 0, n)) do
    local counter, tenant = string.match(m, '^[^\t]*\t([^\t]*)\t(.*)$')
    out[#out + 1] = {tenant = tenant, counter = tonumber(counter)}
  end
  return out
end

-- The counter a tenant that is not backlogged starts from: the least backlogged
-- counter of its class, else the class's floor. Idle time banks no credit.
local function fair_start(K, class)
  local least = fair_backlog(K, class, 1)[1]
  if least then return least.counter end
  return tonumber(rcall('HGET', K.vtc, class .. '\t') or '0') or 0
end

-- The tenant's counter, and whether it is backlogged (listed in fair_tenants).
local function fair_counter(K, class, tenant)
  local own = tonumber(rcall('HGET', K.vtc, class .. '\t' .. tenant) or '')
  if not own then return nil, false end
  return own, rcall('ZSCORE', K.fair_tenants, tenant_member(class, own, tenant)) ~= false
end

-- Make (class, tenant) backlogged, its counter lifted to where its class's backlog is.
local function fair_join(K, class, tenant)
  local own, backlogged = fair_counter(K, class, tenant)
  if backlogged then return end
  local c = math.max(own or 0, fair_start(K, class))
  rcall('HSET', K.vtc, class .. '\t' .. tenant, counter_text(c))
  rcall('ZADD', K.fair_tenants, 0, tenant_member(class, c, tenant))
end

-- Whether the sub-queue of (class, tenant) holds anything.
local function fair_has(K, class, tenant)
  local low, high = lex_range(class .. '\t' .. tenant)
  return #rcall('ZRANGE', K.fair, low, high, 'BYLEX', 'LIMIT', 0, 1) > 0
end

-- Add `tokens` served (0: none) to (class, tenant)'s counter at `weight`, and keep its
-- place in fair_tenants: listed while its sub-queue holds anything (or `stays`: the sole
-- tenant's, FAIR_MODE below). A tenant leaving with a counter at or below the class's
-- floor is forgotten (it would start there).
local function fair_charge(K, class, tenant, tokens, weight, stays)
  local field = class .. '\t' .. tenant
  local own, backlogged = fair_counter(K, class, tenant)
  if backlogged then rcall('ZREM', K.fair_tenants, tenant_member(class, own, tenant)) end
  local c = (own or fair_start(K, class)) + tokens / weight
  if stays or fair_has(K, class, tenant) then
    rcall('HSET', K.vtc, field, counter_text(c))
    rcall('ZADD', K.fair_tenants, 0, tenant_member(class, c, tenant))
  elseif c <= (tonumber(rcall('HGET', K.vtc, class .. '\t') or '0') or 0) then
    rcall('HDEL', K.vtc, field)
  else
    rcall('HSET', K.vtc, field, counter_text(c))
  end
end

-- Sub-queues only once shared. While one tenant's work alone is pending (the queue's
-- sole tenant), the global lookahead serves it as a fair claim would (one tenant), so
-- its requests are not listed in `fair`: a sorted-set write and removal less per
-- request, the costliest ones of a deep backlog. It is charged as before, backlogged in
-- fair_tenants until another tenant becomes the sole one or the queue is listed.
-- The first time another tenant's work would be pending beside the sole tenant's, the
-- queue starts listing: what enters pending from then on is listed, and the backlog is,
-- in rank order, LIST_STEP requests per call (the switching call, then each enqueue and
-- claim: no call holds Redis long, where listing a million at once took seconds); the
-- fair claim waits for the listing to end (until then the global lookahead serves, by
-- age, as before the switch). Then the queue is listed, as before, until a claim leaves
-- nothing listed (the queue drained). vtc's field FAIR_MODE holds which: LISTED, SOLE ..
-- tenant, or LISTING .. the rank the backlog is listed up to (not included); none (a new
-- or drained queue, or one from before this rule): listed when `fair` holds anything.
-- docs/fair-share.md. (Retries waiting in `delayed` may be another tenant's: checked
-- when they come due.)
local FAIR_MODE, LISTED, SOLE, LISTING = '\tmode', 'listed', 'sole\t', 'listing\t'
local LIST_STEP = 10000  -- pending requests a call lists while the queue switches
-- FAIR_MODE as this call read it: {listed: what enters pending is listed, complete: all
-- pending is (the fair claim may read the sub-queues), sole: the sole tenant, from: the
-- rank the listing goes on from}
local fair_state = nil
local function fair_mode(K)
  if not fair_state then
    local v = rcall('HGET', K.vtc, FAIR_MODE) or ''
    if string.sub(v, 1, #SOLE) == SOLE then
      fair_state = {listed = false, complete = false, sole = string.sub(v, #SOLE + 1)}
    elseif string.sub(v, 1, #LISTING) == LISTING then
      fair_state = {listed = true, complete = false, from = string.sub(v, #LISTING + 1)}
    else
      local listed = v == LISTED or #rcall('ZRANGE', K.fair, 0, 0) > 0
      fair_state = {listed = listed, complete = listed}
    end
  end
  return fair_state
end

-- No tenant backlogged any more (fair_tenants emptied; the counters stay in vtc).
local function fair_unjoin_all(K)
  local members = rcall('ZRANGE', K.fair_tenants, 0, -1)
  if #members > 0 then call_chunked('ZREM', K.fair_tenants, members) end
end

-- List these pending ids in their sub-queues, their tenants backlogged (fair_join).
local function fair_list(K, ids)
  if #ids == 0 then return end
  -- an entry is its tokens and a tail the requests of one enqueue call share: each
  -- distinct tail parsed once (into its member's head), not each entry
  local joined, head_of, members = {}, {}, {}
  local scheds = hmget_chunked(K.sched, ids)
  for i, id in ipairs(ids) do
    local tokens, _, tail = split_entry(scheds[i] or '')
    local head = false
    if tokens then
      head = head_of[tail]
      if head == nil then
        local s = parse_sched('0' .. tail)
        head = not s.unreadable and fair_member(s.class, s.tenant, s.rank, '')
        if head then joined[s.class .. '\t' .. s.tenant] = {s.class, s.tenant} end
        head_of[tail] = head
      end
    end
    if head then
      members[#members + 1] = '0'
      members[#members + 1] = head .. id
    end
  end
  if #members > 0 then call_chunked('ZADD', K.fair, members) end
  for _, pair in pairs(joined) do fair_join(K, pair[1], pair[2]) end
end

-- While the queue is listing: list its next LIST_STEP pending requests in rank order (a
-- rank's requests all in one step), and end the listing when none are left.
local function fair_list_step(K)
  local state = fair_mode(K)
  if state.complete or not state.listed then return end
  -- (ZRANGE BYSCORE, not ZRANGEBYSCORE: the producer's ACL, docs/guides/least-privilege.md)
  local got = rcall('ZRANGE', K.pending, state.from, '+inf', 'BYSCORE', 'LIMIT', 0, LIST_STEP,
                    'WITHSCORES')
  local n, ids, last = #got / 2, {}, nil
  if n < LIST_STEP then
    for i = 1, n do ids[i] = got[2 * i - 1] end
  else
    last = tonumber(got[2 * n])
    if tonumber(got[2]) == last then  -- one rank throughout: all of it, however many
      ids, last = rcall('ZRANGE', K.pending, last, last, 'BYSCORE'), last + 1
    else  -- up to the last rank, which the next step reads whole
      for i = 1, n do
        if tonumber(got[2 * i]) < last then ids[#ids + 1] = got[2 * i - 1] end
      end
    end
  end
  fair_list(K, ids)
  if last then
    state.from = fmt_int(last)
    rcall('HSET', K.vtc, FAIR_MODE, LISTING .. state.from)
    return
  end
  state.complete = true
  rcall('HSET', K.vtc, FAIR_MODE, LISTED)
  -- all listed: a tenant backlogged with nothing listed (the sole tenant in a class it
  -- has no work left in) leaves fair_tenants, as a charge would have it leave
  for _, member in ipairs(rcall('ZRANGE', K.fair_tenants, 0, -1)) do
    local class, tenant = string.match(member, '^([^\t]*)\t[^\t]*\t(.*)$')
    if not fair_has(K, class, tenant) then fair_charge(K, class, tenant, 0, 1) end
  end
end

-- Switch the queue to listing (see FAIR_MODE): the backlog's tenants join fair_tenants as
-- it is listed (each at its own counter, or its class's least backlogged one: fair_join;
-- the sole tenant is there already), the first step taken now.
local function fair_start_listing(K)
  local state = fair_mode(K)
  state.listed, state.complete, state.sole, state.from = true, false, nil, '-inf'
  fair_list_step(K)
end

-- Whether requests entering pending now, all of `tenant` (false: of several tenants),
-- are listed in their sub-queues: switching the queue to listing first when they would
-- be pending beside another tenant's work. alone: nothing else is pending (they become the
-- sole tenant's then).
local function fair_listing(K, tenant, alone)
  local state = fair_mode(K)
  if state.listed then
    fair_list_step(K)  -- (while the queue is listing)
    return true
  end
  if tenant and tenant == state.sole then return false end
  if tenant and alone then  -- the sole tenant before it has nothing pending: not backlogged
    fair_unjoin_all(K)
    rcall('HSET', K.vtc, FAIR_MODE, SOLE .. tenant)
    state.sole = tenant
    return false
  end
  fair_start_listing(K)
  return true
end

-- Put a request back in its (class, tenant) sub-queue, once it is in pending again.
-- s: its parsed sched entry.
local function fair_push(K, id, s)
  local state = fair_mode(K)
  if not state.listed and s.tenant ~= state.sole then
    local head = rcall('ZRANGE', K.pending, 0, 1)
    fair_listing(K, s.tenant, #head == 1 and head[1] == id)
  end
  if state.listed then rcall('ZADD', K.fair, 0, fair_member(s.class, s.tenant, s.rank, id)) end
  fair_join(K, s.class, s.tenant)
end

-- Put a request back in pending at its original rank (it keeps its place) and in its
-- sub-queue, counting it in `counts` for add_depth. s: its parsed sched entry.
local function requeue(K, id, s, counts)
  if s.unreadable then  -- at the current time (no rank to keep), in no sub-queue, uncounted
    rcall('ZADD', K.pending, now_ms(), id)
    return
  end
  rcall('ZADD', K.pending, s.rank, id)
  fair_push(K, id, s)
  count_queued(counts, s.class, s.tenant, 1)
end

-- Every key a script touches is in KEYS, as Redis Cluster demands: after a script's
-- fixed keys come the result keys of its ids and the reply lists of their clients
-- (batching/queue.py declares them). A result key not declared is a caller's bug: an
-- error. A reply list not declared (its client was not known to the caller, a race
-- only) is skipped: the waiting client finds the result by polling its key.
-- DECLARED: key -> true for each of KEYS, built at its first lookup (most calls never
-- look: enqueue and complete take their result keys by position).
local DECLARED = setmetatable({}, {__index = function(set, key)
  setmetatable(set, nil)
  for _, k in ipairs(KEYS) do set[k] = true end
  return set[key]
end})
-- Only KEYS[first..] declared: for a script that takes the keys before them by position.
local function declare_only(first)
  setmetatable(DECLARED, nil)
  for i = first, #KEYS do DECLARED[KEYS[i]] = true end
end

local function result_key(result_prefix, id)
  local key = result_prefix .. id
  if not DECLARED[key] then error('batchery: result key not declared in KEYS: ' .. key) end
  return key
end

-- What a result key holds, as text (false: nothing). A key of another type (damaged, or
-- written by another program) reads as its error text, which is no result JSON: a call
-- reading many ids reports that one unreadable and goes on, instead of failing whole.
local function result_text(key)
  local v = redis.pcall('GET', key)
  if type(v) == 'table' then return v.err end
  return v
end

-- The reply list of a client, when there is one and it was declared; else nil.
local function reply_key(reply_prefix, client)
  local key = reply_prefix .. (client or '')
  if client and client ~= '' and DECLARED[key] then return key end
  return nil
end

-- A reply list serves one live client instance; one nobody popped for an hour is
-- garbage (the results stay readable under their own keys for the result TTL).
local REPLY_TTL = 3600

-- A reply list's entry is a result JSON led by KEPT (a space, which JSON reads past): kept
-- under its result key too, which its reader deletes once it delivered it where the queue
-- deletes delivered results; or, pushed onto the list alone (complete.lua), one result
-- JSON or more, a line each (no result JSON holds a newline or starts with a space:
-- batching/calls.py one_line).
local KEPT = ' '

-- The keys of a client's reader beside its reply list (batching/keys.py): its mark
-- ("1": it reads its list alone, "0": it reads it; absent: no reader) and its bell.
local function reader_keys(reply_prefix, client)
  local base = string.sub(reply_prefix, 1, -#'reply:' - 1)
  return base .. 'reader:' .. client, base .. 'bell:' .. client
end

-- A client's reader mark ('1', '0'; false: none, or its keys not declared).
local function reader_mark(reply_prefix, client)
  local reader, bell = reader_keys(reply_prefix, client)
  if not (DECLARED[reader] and DECLARED[bell]) then return false end
  return rcall('GET', reader) or false
end

-- Push results to their clients' reply lists: one RPUSH and one EXPIRE per client, and
-- a ring of its bell while its reader is there. by_client: client id -> list of entries
-- (KEPT or not, above), in commit order; marks: client -> its reader mark, where
-- the caller read it.
local function push_replies(reply_prefix, by_client, ttl, marks)
  for client, jsons in pairs(by_client) do
    local reply = reply_key(reply_prefix, client)
    if reply then
      call_chunked('RPUSH', reply, jsons)
      rcall('EXPIRE', reply, math.min(ttl, REPLY_TTL))
      local mark = marks and marks[client]
      if mark == nil then mark = reader_mark(reply_prefix, client) end
      if mark then  -- (the reader deletes its bells as it reads: they hold a few rings)
        local _, bell = reader_keys(reply_prefix, client)
        rcall('RPUSH', bell, 1)
        rcall('EXPIRE', bell, math.min(ttl, REPLY_TTL))
      end
    end
  end
end

-- Store a result, and push it to the reply list of the client that waits for it.
local function commit_result(result_prefix, reply_prefix, id, client, json, ttl)
  rcall('SET', result_key(result_prefix, id), json, 'EX', ttl)
  if client then push_replies(reply_prefix, {[client] = {KEPT .. json}}, ttl) end
end

-- Dead-letter a request: commit its dead result, kept max(result_ttl, dead_ttl), and
-- list it in `dead` (its request stays, for `batchery queue dead retry`, until the reaper
-- forgets it after dead_ttl).
local function dead_letter(dead_key, result_prefix, reply_prefix, id, client, json, ttl, dead_ttl, now)
  commit_result(result_prefix, reply_prefix, id, client, json, math.max(ttl, dead_ttl))
  rcall('ZADD', dead_key, now, id)
end

-- How each failed run of a request ended (the `history` hash): a JSON list of
-- {type, message}, oldest first, at most max_attempts entries, messages clipped to
-- ENDING_BYTES.
local ENDING_BYTES = 200
local LEASE_EXPIRED = {type = 'LeaseExpired', message = 'lease expired, the worker died or hung'}

-- At most n bytes of s, cut before a whole UTF-8 character, with '...' when cut.
local function clip(s, n)
  if #s <= n then return s end
  local cut = n
  while cut > 0 do
    local b = string.byte(s, cut + 1)
    if b < 128 or b >= 192 then break end  -- not a continuation byte: a character starts
    cut = cut - 1
  end
  return string.sub(s, 1, cut) .. '...'
end

-- Append how this run ended ({type, message}) to the request's history; returns it.
local function record_ending(history_key, id, ending, keep)
  local ok, list = pcall(cjson.decode, rcall('HGET', history_key, id) or '[]')
  if not ok or type(list) ~= 'table' then list = {} end
  list[#list + 1] = {type = clip(ending.type, 100), message = clip(ending.message, ENDING_BYTES)}
  while #list > keep do table.remove(list, 1) end
  rcall('HSET', history_key, id, cjson.encode(list))
  return list
end

-- A dead letter's error: the last runner error (else LeaseExpired), then how each run
-- ended, "boom (attempt 1: RuntimeError: boom; attempt 2: lease expired, ...)".
-- failures: runs counted (history may hold only the last ones); last: this run's
-- runner error in full, when this run raised.
local function dead_error(history, failures, last)
  local parts, runner = {}, nil
  local first = math.max(0, failures - #history)
  for i, e in ipairs(history) do
    local text = '?'
    if type(e) == 'table' and type(e.type) == 'string' and type(e.message) == 'string' then
      if e.type == LEASE_EXPIRED.type then text = e.message else
        text = e.type .. ': ' .. e.message
        runner = e
      end
    end
    parts[i] = 'attempt ' .. fmt_int(first + i) .. ': ' .. text
  end
  runner = last or runner
  local ended = ' (' .. table.concat(parts, '; ') .. ')'
  if runner then return {type = runner.type, message = runner.message .. ended} end
  return {type = LEASE_EXPIRED.type,
          message = 'the worker running this request stopped renewing its lease' .. ended}
end

-- Forget a request's working state (not its result). attempts and history are deleted
-- from even when absent, unless `seldom` (a caller whose ACL has HLEN: the worker's in
-- docs/guides/least-privilege.md; the producer's has none): then only when they hold
-- anything (almost no request fails: an HLEN each, not an HDEL argument per request).
local function forget(keys, ids, seldom)
  call_chunked('HDEL', keys.requests, ids)
  call_chunked('HDEL', keys.sched, ids)
  for _, key in ipairs({keys.attempts, keys.history}) do
    if not seldom or rcall('HLEN', key) > 0 then call_chunked('HDEL', key, ids) end
  end
end

-- Leases are kept per claim, not per request: lease_ids holds the ids each claim still
-- holds under its lease token (newline-separated, in the claim's order; ids hold no
-- control character), lease_expiry when its lease lapses (its worker's heartbeat renews
-- it). A request is held by a claim exactly while it is in that claim's lease; the lease
-- ends with the last one it holds (committed, failed, released, cancelled or reaped).
local function split_ids(text)  -- a lease's text: its ids in order, and as a set
  local ids, held, n = {}, {}, 0
  for id in string.gmatch(text, '[^\n]+') do
    n = n + 1
    ids[n], held[id] = id, true
  end
  return ids, held
end
local function lease_read(K, token)  -- what a claim holds (split_ids)
  return split_ids(rcall('HGET', K.lease_ids, token) or '')
end
local function lease_end(K, token)
  rcall('HDEL', K.lease_ids, token)
  rcall('ZREM', K.lease_expiry, token)
end
-- lease_put(K, token, left): after the HDEL, what the lease still holds (none: it ends).
local function lease_put(K, token, left)
  if #left == 0 then rcall('ZREM', K.lease_expiry, token)
  else rcall('HSET', K.lease_ids, token, table.concat(left, '\n')) end
end
-- Take `gone` (id -> true) out of the lease of `token`; it ends once it holds nothing.
-- (The lease is deleted before what it still holds is written again: a Redis at its
-- maxmemory refuses a script whose first write may grow memory, and one that first frees
-- some, such as a worker giving back its requests (fail, release), must still run.)
-- `ids`: the lease's ids as this call read them (lease_read), so it is not read twice.
local function lease_drop(K, token, gone, ids)
  local left = {}
  ids = ids or lease_read(K, token)
  for _, id in ipairs(ids) do
    if not gone[id] then left[#left + 1] = id end
  end
  if #left == #ids then return end
  rcall('HDEL', K.lease_ids, token)
  lease_put(K, token, left)
end
-- The leases one call checks and lets go of, each read once: book.holds(id, token)
-- whether the claim `token` holds id (and the call has not let go of it);
-- book.let_go(id, token); book.settle() writes what each lease holds then.
local function lease_book(K)
  local read, held, gone, book = {}, {}, {}, {}  -- token -> its ids, as a set, let go of
  function book.holds(id, token)
    if not held[token] then read[token], held[token] = lease_read(K, token); gone[token] = {} end
    return held[token][id] == true and not gone[token][id]
  end
  function book.let_go(id, token)
    if book.holds(id, token) then gone[token][id] = true end
  end
  -- the token of the claim holding `id`, or nil: every lease read, once per call (a
  -- cancel's, rare; the leases hold what the workers run, which their batch sizes bound)
  local holder_of = nil
  function book.holder(id)
    if not holder_of then
      holder_of = {}
      local all = rcall('HGETALL', K.lease_ids)
      for i = 1, #all, 2 do
        for id_held in string.gmatch(all[i + 1], '[^\n]+') do holder_of[id_held] = all[i] end
      end
    end
    local token = holder_of[id]
    return token and book.holds(id, token) and token or nil
  end
  function book.settle()
    for token, ids in pairs(gone) do
      if next(ids) then lease_drop(K, token, ids, read[token]) end
    end
  end
  return book
end
