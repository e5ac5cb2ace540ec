-- complete: commit results of leased requests; only the lease holder's results count.
-- K.requests  K.sched  K.attempts  K.leased  K.owner
-- K.settings  K.stats  K.history
-- KEYS[FIXED+1..] the result key of each id (in ARGV's order), then the reply list of each
--         client among them
-- ARGV[1] result key prefix   ARGV[2] reply list prefix   ARGV[3] default result_ttl
-- ARGV[4] totals to add to stats, "name=n,name=n" (requests, batches, tokens, ...)
-- ARGV[5..] groups of 4: id, lease token, result JSON, client whose reply list gets it
--         ('' for none; the claim handed it to the worker with the request)
-- Returns {c1..cN}: 1 committed; 0 discarded because this claim no longer holds the
--   lease (it expired and was taken over, or the request was cancelled).
-- A replay (the connection retried after the reply was lost) finds its own result
-- stored already: reported 1 again, and the totals are not added twice.
local result_prefix, reply_prefix = ARGV[1], ARGV[2]
local ttl = setting(K.settings, 'result_ttl', tonumber(ARGV[3]))
local ttl_s = fmt_int(ttl)  -- formatted once, not per SET
local n = (#ARGV - 4) / 4
if n == 0 then return {} end

-- the result keys are KEYS[FIXED+1..FIXED+n] in ARGV's order (batching/calls.py declared_keys):
-- taken as declared, not built and looked up again per request; the ends checked
local ids, result_keys = {}, {}
for i = 1, n do
  ids[i] = ARGV[4 + (i - 1) * 4 + 1]
  result_keys[i] = KEYS[FIXED + i]
end
if #KEYS < FIXED + n or result_keys[1] ~= result_prefix .. ids[1]
   or result_keys[n] ~= result_prefix .. ids[n] then
  error('batchery: complete needs the result key of each id in KEYS, in ARGV order')
end
local owners = rcall('HMGET', K.owner, unpack(ids))

local done, flags, replies, replayed = {}, {}, {}, false
for i = 1, n do
  local base = 4 + (i - 1) * 4
  if owners[i] and owners[i] == ARGV[base + 2] then
    local json = ARGV[base + 3]
    rcall('SET', result_keys[i], json, 'EX', ttl_s)
    local client = ARGV[base + 4]
    if client ~= '' then
      replies[client] = replies[client] or {}
      table.insert(replies[client], json)
    end
    done[#done + 1] = ids[i]
    flags[i] = 1
  elseif rcall('GET', result_keys[i]) == ARGV[base + 3] then
    flags[i], replayed = 1, true
  else
    flags[i] = 0
  end
end
declare_only(FIXED + n + 1)  -- the reply lists: the result keys were taken by position
push_replies(reply_prefix, replies, ttl)
if #done > 0 then forget(K, done, true) end
if not replayed then
  for name, v in string.gmatch(ARGV[4], '([^,=]+)=(%d+)') do
    rcall('HINCRBY', K.stats, name, v)
  end
end
return flags
