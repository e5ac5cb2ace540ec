-- complete: commit results of leased requests; only the lease holder's results count.
-- K.requests  K.sched  K.attempts  K.lease_expiry  K.owner
-- K.settings  K.stats  K.history  K.lease_ids
-- KEYS[FIXED+1..] the result key of each id (in ARGV's order), then the reply list of each
--         client among them
-- ARGV[1] result key prefix   ARGV[2] reply list prefix   ARGV[3] default result_ttl
-- ARGV[4] totals to add to stats, "name=n,name=n" (requests, batches, tokens, ...)
-- ARGV[5..] runs of requests that share a lease token and a client: the token, the client
--         whose reply list gets their results ('' for none; the claim handed it to the
--         worker with the request), their count k, then k pairs: id, result JSON
--         (batching/calls.py complete_call: one run for a batch of one claim and one client)
-- Returns {c1..cN}: 1 committed; 0 discarded because this claim no longer holds the
--   lease (it expired and was taken over, or the request was cancelled).
-- A replay (the connection retried after the reply was lost) finds its own result
-- stored already: reported 1 again, and the totals are not added twice.
local result_prefix, reply_prefix = ARGV[1], ARGV[2]
local ttl = setting(K.settings, 'result_ttl', tonumber(ARGV[3]))
local ttl_s = fmt_int(ttl)  -- formatted once, not per SET
-- the ids in ARGV's order, for the one HMGET of their owners
local ids, n, a, n_args = {}, 0, 5, #ARGV
while a <= n_args do
  local k = tonumber(ARGV[a + 2])
  a = a + 3
  for j = 1, k do ids[n + j] = ARGV[a + 2 * j - 2] end
  n, a = n + k, a + 2 * k
end
if n == 0 then return {} end

-- the result keys are KEYS[FIXED+1..FIXED+n] in ARGV's order (batching/calls.py declared_keys):
-- taken as declared, not built and looked up again per request; the ends checked
if #KEYS < FIXED + n or KEYS[FIXED + 1] ~= result_prefix .. ids[1]
   or KEYS[FIXED + n] ~= result_prefix .. ids[n] then
  error('batchery: complete needs the result key of each id in KEYS, in ARGV order')
end
local owners = rcall('HMGET', K.owner, unpack(ids))

local done, flags, replies, replayed = {}, {}, {}, false
local ended = {}  -- token -> the ids this call commits of its lease, in order
local i, d = 0, 0
a = 5
while a <= n_args do
  local token, client, k = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  local mine = ended[token] or {}
  ended[token] = mine
  local jsons = client ~= '' and (replies[client] or {}) or nil
  if jsons then replies[client] = jsons end
  a = a + 3
  for _ = 1, k do
    i = i + 1
    local json, key = ARGV[a + 1], KEYS[FIXED + i]
    if owners[i] == token then
      rcall('SET', key, json, 'EX', ttl_s)
      if jsons then jsons[#jsons + 1] = json end
      d = d + 1
      done[d] = ids[i]
      mine[#mine + 1] = ids[i]
      flags[i] = 1
    elseif rcall('GET', key) == json then
      flags[i], replayed = 1, true
    else
      flags[i] = 0
    end
    a = a + 2
  end
end
for client, jsons in pairs(replies) do  -- a client none of whose results counted: no push
  if #jsons == 0 then replies[client] = nil end
end
declare_only(FIXED + n + 1)  -- the reply lists: the result keys were taken by position
push_replies(reply_prefix, replies, ttl)
if #done > 0 then forget(K, done, true) end
-- a lease whose ids this call commits, all in the claim's order (a batch committed in
-- one call), ends with them; any other is settled by what it still holds
local unsettled = {}
for token, mine in pairs(ended) do
  if #mine > 0 then
    if rcall('HGET', K.lease_ids, token) == table.concat(mine, '\n') then
      lease_end(K, token)
    else
      unsettled[token] = true
    end
  end
end
lease_settle(K, unsettled)
if not replayed then
  for name, v in string.gmatch(ARGV[4], '([^,=]+)=(%d+)') do
    rcall('HINCRBY', K.stats, name, v)
  end
end
return flags
