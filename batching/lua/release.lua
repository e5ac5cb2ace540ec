-- release: give back claims a worker will not run (it is shutting down); no attempt counts.
-- K.lease_expiry  K.pending  K.sched  K.depth
-- K.fair  K.fair_tenants  K.vtc  K.lease_ids
-- ARGV[1..] pairs: id, lease token
-- Each still held by that token returns to pending at its original rank.
-- Returns the number released.
local counts, leases, back = {}, lease_book(K), {}
for i = 1, #ARGV, 2 do
  local id = ARGV[i]
  local raw = rcall('HGET', K.sched, id)
  if raw and leases.holds(id, ARGV[i + 1]) then
    leases.let_go(id, ARGV[i + 1])
    back[#back + 1] = {id, parse_sched(raw)}
  end
end
leases.settle()  -- first (_common.lua lease_drop: maxmemory)
for _, r in ipairs(back) do requeue(K, r[1], r[2], counts) end
add_depth(K.depth, counts)
return #back
