-- Shared helpers, prepended to every script by batching/scripts.py.
local rcall = redis.call

-- The script's fixed keys by name: names[i] is KEYS[i], in the order its header lists.
local function named_keys(names)
  local K = {}
  for i, name in ipairs(names) do K[name] = KEYS[i] end
  return K
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

-- How many of `keys` exist, in slices (see call_chunked).
local function count_existing(keys)
  local found, step = 0, 1000
  for i = 1, #keys, step do
    found = found + rcall('EXISTS', unpack(keys, i, math.min(i + step - 1, #keys)))
  end
  return found
end

-- A queue setting from its hash, else the default the caller passed.
local function setting(settings_key, name, default)
  local v = rcall('HGET', settings_key, name)
  if v then return tonumber(v) or v end
  return default
end

-- sched entry: "tokens:expire_ms:enqueued_ms:rank:class:client"; tokens is "~N" while N
-- is the producer's estimate (no tokenizer there), until a worker writes the exact count
local function parse_sched(s)
  local mark, tokens, expire, enq, rank, class, client =
    string.match(s, '^(~?)(%d+):(%d+):(%d+):([^:]+):([^:]*):(.*)$')
  return {tokens = tonumber(tokens), estimated = mark == '~', expire = tonumber(expire),
          enq = tonumber(enq), rank = tonumber(rank), class = class, client = client}
end

-- How long a worker waits before asking a paused queue again (an enqueue wakes it sooner).
local PAUSED_WAIT_MS = 1000

local function fmt_int(x)
  return string.format('%d', x)
end

-- How long enqueue and fail remember their reply under their call key (Keys.call): the
-- connection's retries after a lost reply give up within about 10 s.
local CALL_MEMORY_S = 60

-- The reply of an earlier run of this call (a retry after a lost reply), or nil.
local function remembered_reply(call_key)
  local saved = rcall('GET', call_key)
  if not saved then return nil end
  local reply = {}
  for v in string.gmatch(saved, '[^,]+') do reply[#reply + 1] = tonumber(v) end
  return reply
end

-- Keep `reply` (a list of integers) so that this call retried gets it again.
local function remember_reply(call_key, reply)
  local parts = {}
  for i, v in ipairs(reply) do parts[i] = fmt_int(v) end
  rcall('SET', call_key, table.concat(parts, ','), 'EX', CALL_MEMORY_S)
  return reply
end

-- Put a request back in pending at its original rank (it keeps its place), counting its
-- class in `counts` for add_depth. s: its parsed sched entry.
local function requeue(pending_key, id, s, counts)
  rcall('ZADD', pending_key, s.rank, id)
  counts[s.class] = (counts[s.class] or 0) + 1
end

-- Counts per priority class, applied with one HINCRBY each.
local function add_depth(depth_key, counts)
  for class, n in pairs(counts) do
    if n ~= 0 then rcall('HINCRBY', depth_key, class, n) end
  end
end

-- Every key a script touches is in KEYS, as Redis Cluster demands: after a script's
-- fixed keys come the result keys of its ids and the reply lists of their clients
-- (batching/queue.py declares them). A result key not declared is a caller's bug: an
-- error. A reply list not declared (its client was not known to the caller, a race
-- only) is skipped: the waiting client finds the result by polling its key.
local DECLARED = {}
for _, key in ipairs(KEYS) do DECLARED[key] = true end

local function result_key(result_prefix, id)
  local key = result_prefix .. id
  if not DECLARED[key] then error('batchery: result key not declared in KEYS: ' .. key) end
  return key
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

-- Push results to their clients' reply lists: one RPUSH and one EXPIRE per client.
-- by_client: client id -> list of result JSON, in commit order.
local function push_replies(reply_prefix, by_client, ttl)
  for client, jsons in pairs(by_client) do
    local reply = reply_key(reply_prefix, client)
    if reply then
      call_chunked('RPUSH', reply, jsons)
      rcall('EXPIRE', reply, math.min(ttl, REPLY_TTL))
    end
  end
end

-- Store a result, and push it to the reply list of the client that waits for it.
local function commit_result(result_prefix, reply_prefix, id, client, json, ttl)
  rcall('SET', result_key(result_prefix, id), json, 'EX', ttl)
  if client then push_replies(reply_prefix, {[client] = {json}}, ttl) end
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

-- Forget a request's working state (not its result). (attempts and history are deleted
-- from even when absent: the worker's least-privilege ACL in README.md has no EXISTS.)
local function forget(keys, ids)
  call_chunked('HDEL', keys.requests, ids)
  call_chunked('HDEL', keys.sched, ids)
  call_chunked('HDEL', keys.attempts, ids)
  call_chunked('HDEL', keys.history, ids)
  call_chunked('HDEL', keys.owner, ids)
  call_chunked('ZREM', keys.leased, ids)
end
