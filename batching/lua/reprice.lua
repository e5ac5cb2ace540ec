-- reprice: a worker writes the exact token counts of requests priced by estimate.
-- KEYS[1] sched      HASH id -> "tokens:expire_ms:enqueued_ms:rank:class:client"
-- ARGV[1..] pairs: id, exact tokens
-- Only an entry still marked "~" (estimated) is rewritten, so a replay after a dropped
-- reply, or two workers pricing the same request, write the same count once.
-- Returns the number of entries rewritten.
local written = 0
for i = 1, #ARGV, 2 do
  local id, tokens = ARGV[i], ARGV[i + 1]
  local raw = rcall('HGET', KEYS[1], id)
  local rest = raw and string.match(raw, '^~%d+(:.*)$')
  if rest and string.match(tokens, '^[1-9]%d*$') then
    rcall('HSET', KEYS[1], id, tokens .. rest)
    written = written + 1
  end
end
return written
