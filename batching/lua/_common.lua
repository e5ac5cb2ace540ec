-- Shared helpers, prepended to every script by batching/scripts.py.
local rcall = redis.call

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

local function fmt_int(x)
  return string.format('%d', x)
end

-- Counts per priority class, applied with one HINCRBY each.
local function add_depth(depth_key, counts)
  for class, n in pairs(counts) do
    if n ~= 0 then rcall('HINCRBY', depth_key, class, n) end
  end
end

-- A reply list serves one live client instance; one nobody popped for an hour is
-- garbage (the results stay readable under their own keys for the result TTL).
local REPLY_TTL = 3600

-- Store a result, and push it to the reply list of the client that waits for it.
local function commit_result(result_prefix, reply_prefix, id, client, json, ttl)
  rcall('SET', result_prefix .. id, json, 'EX', ttl)
  if client ~= '' then
    local reply = reply_prefix .. client
    rcall('RPUSH', reply, json)
    rcall('EXPIRE', reply, math.min(ttl, REPLY_TTL))
  end
end

-- Push results to their clients' reply lists: one RPUSH and one EXPIRE per client.
-- by_client: client id -> list of result JSON, in commit order.
local function push_replies(reply_prefix, by_client, ttl)
  for client, jsons in pairs(by_client) do
    local reply = reply_prefix .. client
    call_chunked('RPUSH', reply, jsons)
    rcall('EXPIRE', reply, math.min(ttl, REPLY_TTL))
  end
end

-- Forget a request's working state (not its result).
local function forget(keys, ids)
  call_chunked('HDEL', keys.requests, ids)
  call_chunked('HDEL', keys.sched, ids)
  call_chunked('HDEL', keys.attempts, ids)
  call_chunked('HDEL', keys.owner, ids)
  call_chunked('ZREM', keys.leased, ids)
end
