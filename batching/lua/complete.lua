-- complete: commit results of leased requests; only the lease holder's results count.
-- K.requests  K.sched  K.attempts  K.lease_expiry  K.lease_ids
-- K.settings  K.stats  K.history
-- KEYS[FIXED+1..] the result key of each id (in ARGV's order: the id is the key past the
--         prefix ARGV[1], sent once), then the reply list of each client among them
-- ARGV[1] result key prefix   ARGV[2] reply list prefix   ARGV[3] default result_ttl
-- ARGV[4] totals to add to stats, "name=n,name=n" (requests, batches, tokens, ...)
-- ARGV[5..] runs of requests that share a lease token and a client: the token, the client
--         whose reply list gets their results ('' for none; the claim handed it to the
--         worker with the request), their count k, then k result JSONs
--         (batching/calls.py complete_call: one run for a batch of one claim and one client)
-- Returns "c1..cN", one text of a digit a request (as enqueue's): 1 committed; 0 discarded
--   because this claim no longer holds the lease (it expired and was taken over, or the
--   request was cancelled).
-- A replay (the connection retried after the reply was lost) finds its own result
-- stored already: reported 1 again, and the totals are not added twice.
local result_prefix, reply_prefix = ARGV[1], ARGV[2]
local ttl = setting(K.settings, 'result_ttl', tonumber(ARGV[3]))
local ttl_s = fmt_int(ttl)  -- formatted once, not per SET
local n, a, n_args = 0, 5, #ARGV
while a <= n_args do
  local k = tonumber(ARGV[a + 2])
  n, a = n + k, a + 3 + k
end
if n == 0 then return '' end
-- the result keys are KEYS[FIXED+1..FIXED+n] in ARGV's order (batching/calls.py declared_keys):
-- taken as declared, not built and looked up again per request
local ids = ids_in_result_keys(result_prefix, FIXED + 1, n, true, 'complete')
-- each lease token's ids among them
local of_token, i = {}, 0
a = 5
while a <= n_args do
  local token, k = ARGV[a], tonumber(ARGV[a + 2])
  local mine = of_token[token] or {}
  of_token[token] = mine
  local m = #mine
  for j = 1, k do mine[m + j] = ids[i + j] end
  i, a = i + k, a + 3 + k
end
-- What each token's lease still holds of its ids: all of them when the lease is exactly
-- its ids in order (a batch committed whole, the common case: one string compared, no id
-- looked up), else the set the lease holds.
local holds, gone, read = {}, {}, {}  -- gone, read: token -> the ids committed of a lease
-- held in part, and the lease's ids as read
for token, mine in pairs(of_token) do
  local leased = rcall('HGET', K.lease_ids, token)
  if leased == table.concat(mine, '\n') then holds[token] = true
  else read[token], holds[token] = split_ids(leased or ''); gone[token] = {} end
end

local done, flags, replies, replayed = {}, {}, {}, false
local d = 0
i, a = 0, 5
while a <= n_args do
  local token, client, k = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  local jsons = client ~= '' and (replies[client] or {}) or nil
  if jsons then replies[client] = jsons end
  local held = holds[token]
  a = a + 3
  for _ = 1, k do
    i = i + 1
    local json, key = ARGV[a], KEYS[FIXED + i]
    if held == true or held[ids[i]] then
      rcall('SET', key, json, 'EX', ttl_s)
      if jsons then jsons[#jsons + 1] = json end
      d = d + 1
      done[d] = ids[i]
      if held ~= true then gone[token][ids[i]] = true end
      flags[i] = '1'
    elseif result_text(key) == json then
      flags[i], replayed = '1', true
    else
      flags[i] = '0'
    end
    a = a + 1
  end
end
for client, jsons in pairs(replies) do  -- a client none of whose results counted: no push
  if #jsons == 0 then replies[client] = nil end
end
declare_only(FIXED + n + 1)  -- the reply lists: the result keys were taken by position
push_replies(reply_prefix, replies, ttl)
if #done > 0 then forget(K, done, true) end
-- the leases: one whose ids this call committed whole ends; any other lets go of the
-- ones committed
for token, held in pairs(holds) do
  if held == true then lease_end(K, token)
  elseif next(gone[token]) then lease_drop(K, token, gone[token], read[token]) end
end
if not replayed then
  for name, v in string.gmatch(ARGV[4], '([^,=]+)=(%d+)') do
    rcall('HINCRBY', K.stats, name, v)
  end
end
return table.concat(flags)
