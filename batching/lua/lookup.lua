-- lookup: where each request is, in one atomic read: finished, still in the queue, or gone.
-- K.requests  HASH id -> request JSON (queued, running or dead-lettered)
-- KEYS[FIXED+1..]  the result key of each id, in ARGV's order
-- ARGV[1..]  request ids
-- Returns {r1..rN}: ri is the result JSON when there is one (what its key holds: for a key
--   of another type the error text, which its reader reports as unreadable); else 1 when
--   the request is still queued, running or dead-lettered; else 0: Redis knows nothing of
--   it (never enqueued, result expired or deleted once delivered, or lost by Redis itself).
local out = {}
for i = 1, #ARGV do
  local result = result_text(KEYS[FIXED + i])
  if result then
    out[i] = result
  else
    out[i] = rcall('HEXISTS', K.requests, ARGV[i])
  end
end
return out
