-- complete: commit results of leased requests; only the lease holder's results count.
-- K.requests  K.sched  K.attempts  K.lease_expiry  K.lease_ids
-- K.settings  K.stats  K.history  K.call this call's reply, remembered (see Returns)
-- KEYS[FIXED+1..] keyed (ARGV[6] 1): the result key of each id (in ARGV's order: the id is
--         the key past the prefix ARGV[1], sent once); then, either way, the reply list,
--         reader mark and bell of each client among them (batching/calls.py declared_keys)
-- ARGV[1] result key prefix   ARGV[2] reply list prefix   ARGV[3] default result_ttl
-- ARGV[4] totals to add to stats, "name=n,name=n" (requests, batches, tokens, ...)
-- ARGV[5] default delete_delivered (1 or 0)
-- ARGV[6] 1: keyed, as above; 0: keyless, no result key declared, each run's ids in ARGV
--         and its results one text (a key a request fewer: a commit whose results all go
--         to reply lists alone touches none). A keyless call that would store a result under its key
--         (one of no client, or of a client whose results are not listed alone) is refused
--         whole, writing nothing: it returns KEYS_NEEDED and those clients, a line each
--         ("keys\nclient..."), and its caller sends it keyed.
-- ARGV[7..] runs of requests that share a lease token and a client: the token, the client
--         whose reply list gets their results ('' for none; the claim handed it to the
--         worker with the request), their count k, then k result JSONs (keyless: k ids,
--         then their k result JSONs joined by newlines (none holds one: batching/calls.py
--         one_line) (one run for a batch of one claim and one client)
-- A result goes to its client's reply list alone while that client's reader reads it
-- alone (its mark is "1": batching/keys.py reader_prefix) and the queue deletes delivered
-- results: the reader takes it within a read, and a key written to be deleted a moment
-- later was a sixth of what a request cost Redis. Else it is kept under its key for
-- result_ttl too, and pushed marked as kept there (KEPT: the reader deletes it once
-- delivered). What a reader that stopped leaves on its list is kept under the keys then,
-- by the reaper (drain.lua). A keyless run whose lease is held whole is pushed as the one
-- text it came in: one list entry for its k results (a reader splits an entry at its
-- newlines: batching/reply_lists.py), not k, each of which cost the script a value in,
-- a value pushed and a value read back.
-- Returns "c1..cN", one text of a digit a request (as enqueue's): 1 committed; 0 discarded
--   because this claim no longer holds the lease (it expired and was taken over, or the
--   request was cancelled); or KEYS_NEEDED (above).
-- A replay (the connection retried after the reply was lost) gets the first run's reply,
-- remembered under K.call for 60 s (as enqueue's), and changes nothing: a result pushed
-- onto a list alone has no key to find it by, and the totals are not added twice.
local remembered = rcall('GET', K.call)
if remembered then return remembered end
local result_prefix, reply_prefix = ARGV[1], ARGV[2]
local ttl = setting(K.settings, 'result_ttl', tonumber(ARGV[3]))
local ttl_s = fmt_int(ttl)  -- formatted once, not per SET
local lists_alone = setting(K.settings, 'delete_delivered', tonumber(ARGV[5])) == 1
local KEYS_NEEDED = 'keys'
local keyed = ARGV[6] == '1'
local function run_length(k)  -- ARGV values a run of k takes: keyed its JSONs, keyless its
  return keyed and 3 + k or 4 + k  -- ids and their joined JSONs
end
local FIRST_RUN = 7
local n, a, n_args = 0, FIRST_RUN, #ARGV
while a <= n_args do
  local k = tonumber(ARGV[a + 2])
  n, a = n + k, a + run_length(k)
end
if n == 0 then return '' end
-- keyed, the result keys are KEYS[FIXED+1..FIXED+n] in ARGV's order (batching/calls.py
-- declared_keys): taken as declared, not built and looked up again per request
local ids = keyed and ids_in_result_keys(result_prefix, FIXED + 1, n, 'complete') or {}
declare_only(FIXED + (keyed and n or 0) + 1)  -- the reply lists (the result keys: by position)
-- whether a client's results go to its reply list alone (its reader reads it alone)
local marks = {}  -- client -> its reader mark, read once
local function list_alone(client)
  local mark = marks[client]
  if mark == nil then
    mark = reply_key(reply_prefix, client) ~= nil and reader_mark(reply_prefix, client)
    marks[client] = mark
  end
  return lists_alone and mark == '1'
end
-- each lease token's ids among them; keyless, the clients whose results would have to be
-- stored under keys (none of no client, or of one not read alone, or none is committed here)
local of_token, needed, listed, i = {}, {}, {}, 0
a = FIRST_RUN
while a <= n_args do
  local token, client, k = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  local mine = of_token[token] or {}
  of_token[token] = mine
  local m = #mine
  if not keyed then
    for j = 1, k do ids[i + j] = ARGV[a + 2 + j] end
    if (client == '' or not list_alone(client)) and not listed[client] then
      listed[client] = true
      needed[#needed + 1] = client
    end
  end
  for j = 1, k do mine[m + j] = ids[i + j] end
  i, a = i + k, a + run_length(k)
end
if #needed > 0 then return KEYS_NEEDED .. '\n' .. table.concat(needed, '\n') end
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
-- A keyless run's k results, cut from their joined text at each newline (a run held in
-- part: its lease lost for some); refused whole, before anything is written, unless they
-- are k.
local function joined_results(text, k)
  local results, n, from = {}, 0, 1
  while true do
    local newline = string.find(text, '\n', from, true)
    n = n + 1
    results[n] = string.sub(text, from, (newline or 0) - 1)
    if not newline then break end
    from = newline + 1
  end
  if n ~= k then error('batchery: complete needs a run\'s ' .. k .. ' results joined by newlines') end
  return results
end
local done, flags, replies = {}, {}, {}
local d = 0
i, a = 0, FIRST_RUN
while a <= n_args do
  local token, client, k = ARGV[a], ARGV[a + 1], tonumber(ARGV[a + 2])
  local jsons = client ~= '' and (replies[client] or {}) or nil
  if jsons then replies[client] = jsons end
  local alone = jsons and list_alone(client)
  local held = holds[token]
  local joined = not keyed and ARGV[a + 3 + k]  -- (keyless: alone, as checked above)
  local whole = joined and held == true
  if whole then jsons[#jsons + 1] = joined end  -- pushed as it came: one entry
  local results = joined and not whole and joined_results(joined, k) or nil
  a = a + 3
  for j = 1, k do
    i = i + 1
    if held == true or held[ids[i]] then
      if not whole then
        local json = keyed and ARGV[a + j - 1] or results[j]
        if alone then jsons[#jsons + 1] = json
        else  -- (keyed: a keyless call is alone)
          rcall('SET', KEYS[FIXED + i], json, 'EX', ttl_s)
          if jsons then jsons[#jsons + 1] = KEPT .. json end
        end
      end
      d = d + 1
      done[d] = ids[i]
      if held ~= true then gone[token][ids[i]] = true end
      flags[i] = '1'
    else
      flags[i] = '0'
    end
  end
  a = a + run_length(k) - 3
end
for client, jsons in pairs(replies) do  -- a client none of whose results counted: no push
  if #jsons == 0 then replies[client] = nil end
end
push_replies(reply_prefix, replies, ttl, marks)
if #done > 0 then forget(K, done, true) end
-- the leases: one whose ids this call committed whole ends; any other lets go of the
-- ones committed
for token, held in pairs(holds) do
  if held == true then lease_end(K, token)
  elseif next(gone[token]) then lease_drop(K, token, gone[token], read[token]) end
end
for name, v in string.gmatch(ARGV[4], '([^,=]+)=(%d+)') do
  rcall('HINCRBY', K.stats, name, v)
end
local reply = table.concat(flags)
rcall('SET', K.call, reply, 'EX', CALL_MEMORY_S)
return reply
