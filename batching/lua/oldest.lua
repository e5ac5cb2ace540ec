-- oldest: when the oldest pending request of each priority class was enqueued (aging
-- made visible, for `batchery dashboard`). Read-only.
-- K.pending  ZSET id -> rank (enqueue ms + class delay ms)
-- K.sched    HASH id -> "tokens:expire_ms:enqueued_ms:rank:class:client"
-- ARGV[1] most requests to look at, from the head (bounds the script's time)
-- ARGV[2..] the classes to find: the walk stops as soon as it has seen each of them
-- Returns {now_ms, looked_at, class1, enqueued_ms1, class2, enqueued_ms2, ...}: a class
--   missing from the reply had no pending request among the first looked_at.
-- Within one class the rank is enqueue time plus one constant, so the first request of
-- a class in rank order is its oldest (an integer priority, reported under the class it
-- is at least as urgent as, may be off by the difference of the delays).
local limit = tonumber(ARGV[1])
local wanted, missing = {}, 0
for i = 2, #ARGV do
  if not wanted[ARGV[i]] then wanted[ARGV[i]] = true; missing = missing + 1 end
end
local out, looked, step = {now_ms(), 0}, 0, 200
while missing > 0 and looked < limit do
  local ids = rcall('ZRANGE', K.pending, looked, math.min(looked + step, limit) - 1)
  if #ids == 0 then break end
  local scheds = rcall('HMGET', K.sched, unpack(ids))
  for i = 1, #ids do
    if scheds[i] then
      local s = parse_sched(scheds[i])
      if wanted[s.class] then
        wanted[s.class] = nil
        missing = missing - 1
        out[#out + 1] = s.class
        out[#out + 1] = s.enq
      end
    end
  end
  looked = looked + #ids
end
out[2] = looked
return out
