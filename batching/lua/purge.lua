-- purge: forget dead-lettered requests for good (`batchery queue dead purge`).
-- K.dead  K.requests  K.sched  K.attempts  K.history
-- ARGV[1] 1: every dead request; 0: only the ids that follow
-- ARGV[2..] ids (any string, '*' included, is one id)
-- Their dead results stay readable until the result TTL.
-- Returns the number purged.
local ids = {}
if ARGV[1] == '1' then ids = rcall('ZRANGE', K.dead, 0, -1) else
  for i = 2, #ARGV do
    if rcall('ZSCORE', K.dead, ARGV[i]) then ids[#ids + 1] = ARGV[i] end
  end
end
if #ids == 0 then return 0 end
call_chunked('ZREM', K.dead, ids)
forget(K, ids)
return #ids
