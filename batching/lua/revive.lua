-- revive: send dead-lettered requests back to the queue (`batchery queue dead retry`).
-- K.dead  K.pending  K.sched  K.attempts  K.depth
-- K.requests  K.history  K.fair  K.fair_tenants  K.vtc
-- KEYS[FIXED+1..] the result key of each id, in ARGV's order
-- ARGV[1] result key prefix   ARGV[2..] ids (any string, '*' included, is one id; the
--   caller lists every dead letter for `--all`)
-- Each gets a fresh attempt count and history, and its original rank, so it runs soon;
-- its dead result is deleted so that the new run commits the one result.
-- Returns the number revived.
local revived, counts = 0, {}
for i = 2, #ARGV do
  local id = ARGV[i]
  local raw = rcall('HGET', K.sched, id)
  if rcall('ZREM', K.dead, id) == 1 and raw and rcall('HEXISTS', K.requests, id) == 1 then
    local s = parse_sched(raw)
    rcall('HDEL', K.attempts, id)
    rcall('HDEL', K.history, id)
    rcall('DEL', result_key(ARGV[1], id))
    requeue(K, id, s, counts)
    revived = revived + 1
  end
end
add_depth(K.depth, counts)
return revived
