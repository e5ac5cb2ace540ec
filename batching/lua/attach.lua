-- attach: put the output a worker generated before its request was cancelled into the
-- request's cancelled result (a generation's partial text, finish_reason "cancelled").
-- K.cancelled the request's cancelled-lease key (Keys.cancelled)   K.result its result key
-- ARGV[1] the lease token the worker claimed it with
-- ARGV[2] the stored result JSON the worker read (cancelled, no output)
-- ARGV[3] that result with the output in it
-- Returns 1 attached; 0 not: the cancel found another lease (or none: it was queued),
--   the result changed since it was read (an attach was made already) or is gone.
-- The result stays the one the cancel committed (same status, same expiry), filled in
-- once, only by the worker that held the lease when the cancel came; nothing is pushed
-- to the client's reply list (it had the cancel's reply; the stream's end tells a
-- reader to read the result again).
if rcall('GET', K.cancelled) ~= ARGV[1] then return 0 end
if rcall('GET', K.result) ~= ARGV[2] then return 0 end
rcall('SET', K.result, ARGV[3], 'KEEPTTL')
return 1
