-- renew: a worker's heartbeat; extends the leases it still holds.
-- K.leased  K.owner  K.settings  K.workers
-- ARGV[1] worker id   ARGV[2] default lease_seconds
-- ARGV[3..] pairs: id, lease token
-- Returns the ids whose lease this worker no longer holds (taken over or cancelled):
-- the worker must not expect to commit them.
local now = now_ms()
local lease_ms = math.floor(setting(K.settings, 'lease_seconds', tonumber(ARGV[2])) * 1000)
rcall('ZADD', K.workers, now, ARGV[1])
local lost = {}
for i = 3, #ARGV, 2 do
  local id = ARGV[i]
  if rcall('HGET', K.owner, id) == ARGV[i + 1] then
    rcall('ZADD', K.leased, 'XX', now + lease_ms, id)
  else
    lost[#lost + 1] = id
  end
end
return lost
