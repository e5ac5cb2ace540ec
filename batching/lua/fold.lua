-- fold: keep the per-tenant fields that outlive a tenant's backlog bounded (run by the
-- reaper, batching/queue.py reap). A million job ids as tenants leave no million fields.
-- K.served        HASH tenant -> tokens claimed; FOLDED_TOKENS and FOLDED_TENANTS: those
--                 of the tenants folded away, summed (a tab starts no tenant's name)
-- K.depth         HASH tenant:NAME -> queued requests (a tenant with work is not folded)
-- K.vtc  K.fair_tenants   the fair-share counters (_common.lua fair_*)
-- ARGV[1] keep: when served names more tenants than this, the idle ones with the fewest
--         tokens are folded until it names keep / 2 (so it runs once per keep / 2 new
--         tenants; the most served stay by name, as `queue stats` shows them)
-- ARGV[2] cursor, ARGV[3] count: the HSCAN page of vtc looked at this call; a counter at
--         or below its class's floor, of a tenant not backlogged, is dropped (it would
--         start at the floor or above anyway: fair_join), as fair_charge does when it can
-- Returns {tenants folded, the next vtc cursor, counters dropped}.
local FOLDED_TOKENS, FOLDED_TENANTS = '\tfolded_tokens', '\tfolded_tenants'
local keep = tonumber(ARGV[1])
local folded = 0
if rcall('HLEN', K.served) > keep + 2 then
  local flat, idle, named = rcall('HGETALL', K.served), {}, 0
  for i = 1, #flat, 2 do
    local tenant = flat[i]
    if string.byte(tenant, 1) ~= 9 then
      named = named + 1
      if rcall('HEXISTS', K.depth, TENANT_DEPTH .. tenant) == 0 then
        idle[#idle + 1] = {tenant, tonumber(flat[i + 1]) or 0}
      end
    end
  end
  table.sort(idle, function(x, y) return x[2] < y[2] or (x[2] == y[2] and x[1] < y[1]) end)
  local over = named - math.floor(keep / 2)
  local fields, tokens = {}, 0
  for i = 1, math.min(over, #idle) do
    fields[i] = idle[i][1]
    tokens = tokens + idle[i][2]
  end
  if #fields > 0 then
    call_chunked('HDEL', K.served, fields)
    rcall('HINCRBY', K.served, FOLDED_TOKENS, tokens)
    rcall('HINCRBY', K.served, FOLDED_TENANTS, #fields)
    folded = #fields
  end
end

local page = rcall('HSCAN', K.vtc, ARGV[2], 'COUNT', tonumber(ARGV[3]))
local floors, dropped = {}, {}
for i = 1, #page[2], 2 do
  local field, counter = page[2][i], tonumber(page[2][i + 1])
  local class, tenant = string.match(field, '^([^\t]*)\t(.+)$')
  if class and class ~= '' and counter then  -- ('\tmode' is FAIR_MODE, no counter)
    floors[class] = floors[class] or tonumber(rcall('HGET', K.vtc, class .. '\t') or '0') or 0
    if counter <= floors[class]
        and not rcall('ZSCORE', K.fair_tenants, tenant_member(class, counter, tenant)) then
      dropped[#dropped + 1] = field
    end
  end
end
if #dropped > 0 then call_chunked('HDEL', K.vtc, dropped) end
return {folded, page[1], #dropped}
