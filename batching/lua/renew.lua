-- renew: a worker's heartbeat; extends the leases it still holds.
-- K.lease_expiry  K.lease_ids  K.settings  K.workers
-- ARGV[1] worker id   ARGV[2] default lease_seconds
-- ARGV[3..] pairs: id, lease token
-- Returns the ids whose lease this worker no longer holds (taken over or cancelled):
-- the worker must not expect to commit them. The leases (one per claim) of the ones it
-- holds are extended.
local now = now_ms()
local lease_ms = math.floor(setting(K.settings, 'lease_seconds', tonumber(ARGV[2])) * 1000)
rcall('ZADD', K.workers, now, ARGV[1])
local lost, tokens, leases = {}, {}, lease_book(K)
for i = 3, #ARGV, 2 do
  local id, token = ARGV[i], ARGV[i + 1]
  if leases.holds(id, token) then tokens[token] = true else lost[#lost + 1] = id end
end
local expiry = fmt_int(now + lease_ms)
for token in pairs(tokens) do rcall('ZADD', K.lease_expiry, 'XX', expiry, token) end
return lost
