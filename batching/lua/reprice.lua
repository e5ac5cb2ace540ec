-- reprice: a worker writes the exact token counts of requests priced by estimate.
-- KEYS[1] sched      HASH id -> "tokens:expire_ms:enqueued_ms:rank:class:client"
-- ARGV[1..] pairs: id, exact tokens
-- Only an entry still marked "~" (estimated) is rewritten, so a replay after a dropped
-- reply, or two workers pricing the same request, write the same count once.
-- Returns the number of entries rewritten.
local ids = {}
for i = 1, #ARGV, 2 do ids[#ids + 1] = ARGV[i] end
local raws = hmget_chunked(KEYS[1], ids)
local writes, written = {}, {}
for n, id in ipairs(ids) do
  local tokens = ARGV[2 * n]
  local rest = raws[n] and string.match(raws[n], '^~%d+(:.*)$')
  if rest and not written[id] and string.match(tokens, '^[1-9]%d*$') then
    written[id] = true  -- an id twice in one call: its first count, as one at a time
    writes[#writes + 1] = id
    writes[#writes + 1] = tokens .. rest
  end
end
call_chunked('HSET', KEYS[1], writes)
return #writes / 2
