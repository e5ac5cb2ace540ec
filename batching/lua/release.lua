-- release: give back claims a worker will not run (it is shutting down); no attempt counts.
-- K.lease_expiry  K.owner  K.pending  K.sched  K.depth
-- K.fair  K.fair_tenants  K.vtc  K.lease_ids
-- ARGV[1..] pairs: id, lease token
-- Each still held by that token returns to pending at its original rank.
-- Returns the number released.
local released, counts, tokens = 0, {}, {}
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  local raw = rcall('HGET', K.sched, id)
  if raw and rcall('HGET', K.owner, id) == ARGV[i + 1] then
    local s = parse_sched(raw)
    rcall('HDEL', K.owner, id)
    tokens[ARGV[i + 1]] = true
    requeue(K, id, s, counts)
    released = released + 1
  end
end
lease_settle(K, tokens)
add_depth(K.depth, counts)
return released
