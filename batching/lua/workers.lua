-- workers: count the live workers on the queue's own clock, forgetting long-silent ones.
-- K.workers   ZSET worker id -> last heartbeat ms
-- K.settings  HASH
-- ARGV[1] default lease_seconds
-- ARGV[2] forget workers not heard from in this many ms (0: forget none)
-- The clock is this node's TIME, the one heartbeats are stamped with (a client's TIME
-- may ask another node of a Cluster). A worker is live when heard from within
-- lease_seconds.
-- Returns the number of live workers.
local now = now_ms()
local forget_ms = tonumber(ARGV[2])
if forget_ms > 0 then rcall('ZREMRANGEBYSCORE', K.workers, '-inf', now - forget_ms) end
local lease_ms = setting(K.settings, 'lease_seconds', tonumber(ARGV[1])) * 1000
return rcall('ZCOUNT', K.workers, now - lease_ms, '+inf')
