-- drain: keep under their result keys the results a reader that stopped left behind.
-- K.settings  K.readers  SET of the clients whose readers read here (batching/keys.py)
-- KEYS[FIXED+1..FIXED+5] the client's reader mark, reply list, both inboxes and bell
-- KEYS[FIXED+6..] the result key of each result pushed onto its list alone that the
--         caller read there (batching/calls.py drain_call)
-- ARGV[1] the client   ARGV[2] result key prefix   ARGV[3] default result_ttl
-- While its reader marked it "1", a commit pushed a client's results onto its list alone
-- (complete.lua); once the mark lapsed (the client closed, or died), what the list and
-- the inboxes of its last reads still hold nobody will read: each result pushed alone is
-- stored under its key for result_ttl, as a commit stores any other, and the lists go.
-- An entry marked KEPT is under its key already; any other holds one result JSON or more,
-- a line each (a commit's run pushed whole: complete.lua); one that is no result JSON with
-- an id (not a worker's) cannot be stored by id and goes with the lists.
-- Returns the results stored; 0 with nothing done while the mark is set again (the
-- reader is back); -1 with nothing done when a result's key was not declared (pushed
-- after the caller read: it reads again).
local reader, list, bell = KEYS[FIXED + 1], KEYS[FIXED + 2], KEYS[FIXED + 5]
local lists = {KEYS[FIXED + 3], KEYS[FIXED + 4], list}
local client, result_prefix = ARGV[1], ARGV[2]
if rcall('EXISTS', reader) == 1 then return 0 end
declare_only(FIXED + 6)
local keep = {}
for _, key in ipairs(lists) do
  for _, entry in ipairs(rcall('LRANGE', key, 0, -1)) do
    for json in string.gmatch(string.sub(entry, 1, 1) ~= KEPT and entry or '', '[^\n]+') do
      local ok, result = pcall(cjson.decode, json)
      local id = ok and type(result) == 'table' and result.id
      if type(id) == 'string' then
        local rkey = result_prefix .. id
        if not DECLARED[rkey] then return -1 end
        keep[#keep + 1] = {rkey, json}
      end
    end
  end
end
local ttl = setting(K.settings, 'result_ttl', tonumber(ARGV[3]))
for _, pair in ipairs(keep) do rcall('SET', pair[1], pair[2], 'EX', ttl) end
rcall('DEL', lists[1], lists[2], list, bell)
rcall('SREM', K.readers, client)
return #keep
