-- fail: a leased request failed; schedule a retry with backoff, or dead-letter it.
-- K.requests  K.sched  K.attempts  K.lease_expiry
-- K.delayed   K.dead   K.settings  K.depth   K.stats
-- K.history   K.call  STRING this call's reply, remembered (see Returns)   K.lease_ids
-- KEYS[FIXED+1..] the result key of each id, then the reply list, reader mark and bell of each
--   client among them (batching/calls.py declared_keys)
-- ARGV[1] result key prefix   ARGV[2] reply list prefix
-- ARGV[3] default max_attempts   ARGV[4] default result_ttl
-- ARGV[5] backoff base ms        ARGV[6] backoff cap ms   ARGV[7] default dead_ttl
-- ARGV[8..] groups of 3: id, lease token, the dead result JSON (its error is the run's)
-- Each failure appends the run's error to the request's `history`. The n-th failure
-- waits min(cap, base * 2^(n-1)) ms in `delayed`; failure number max_attempts commits
-- the dead result, its error now this run's followed by how each attempt ended, adds
-- the id to `dead`, and keeps the request (for `batchery queue dead retry`) until the reaper
-- forgets it after dead_ttl; the dead result lives max(result_ttl, dead_ttl).
-- Returns {f1..fN}: 1 retry scheduled, 2 dead-lettered, 0 discarded (lease lost).
-- Idempotent: a call that retried or dead-lettered an id remembers its reply under
-- K.call for 60 s; the same call again (the connection retried after a lost reply)
-- gets that reply back (its values as texts of digits), not 0 for the leases its first
-- run released.
local remembered = remembered_reply(K.call)
if remembered then return remembered end
local result_prefix, reply_prefix = ARGV[1], ARGV[2]
local max_attempts = setting(K.settings, 'max_attempts', tonumber(ARGV[3]))
local ttl = setting(K.settings, 'result_ttl', tonumber(ARGV[4]))
local base_ms, cap_ms = tonumber(ARGV[5]), tonumber(ARGV[6])
local dead_ttl = setting(K.settings, 'dead_ttl', tonumber(ARGV[7]))
local now = now_ms()
local flags, counts, retried, dead, leases = {}, {}, 0, 0, lease_book(K)
local n_items, held = (#ARGV - 7) / 3, {}
for i = 1, n_items do  -- the leases let go of first (_common.lua lease_drop: maxmemory)
  local id, token = ARGV[7 + 3 * i - 2], ARGV[7 + 3 * i - 1]
  held[i] = leases.holds(id, token)
  if held[i] then leases.let_go(id, token) end
end
leases.settle()
for i = 1, n_items do
  local base = 7 + (i - 1) * 3
  local id = ARGV[base + 1]
  if not held[i] then
    flags[i] = 0
  else
    local failures = rcall('HINCRBY', K.attempts, id, 1)
    local s = parse_sched(rcall('HGET', K.sched, id) or '0:0:0:0::')
    local json = ARGV[base + 3]
    local ok, result = pcall(cjson.decode, json)
    if not ok or type(result) ~= 'table' then result = {} end
    local err = type(result.error) == 'table' and result.error or {}
    local ending = {type = type(err.type) == 'string' and err.type or 'Error',
                    message = type(err.message) == 'string' and err.message or ''}
    local history = record_ending(K.history, id, ending, max_attempts)
    if failures >= max_attempts then
      if ok and type(result.error) == 'table' then
        result.error = dead_error(history, failures, ending)
        json = cjson.encode(result)
      end
      dead_letter(K.dead, result_prefix, reply_prefix, id, s.client or '', json, ttl, dead_ttl, now)
      flags[i], dead = 2, dead + 1
    else
      local wait = math.min(cap_ms, base_ms * math.pow(2, failures - 1))
      rcall('ZADD', K.delayed, now + math.floor(wait), id)
      if s.class ~= '' then count_queued(counts, s.class, s.tenant, 1) end  -- '': no sched
      flags[i], retried = 1, retried + 1
    end
  end
end
add_depth(K.depth, counts)
if retried > 0 then rcall('HINCRBY', K.stats, 'retries', retried) end
if dead > 0 then rcall('HINCRBY', K.stats, 'dead', dead) end
if retried + dead > 0 then remember_reply(K.call, flags) end
return flags
