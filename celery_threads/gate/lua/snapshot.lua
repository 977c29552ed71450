-- snapshot: a consistent read of one thread (no writes), for inspection.
--   KEYS[1] active   KEYS[2] queue   KEYS[3] the shard's tasks hash   KEYS[4] the shard's due index
--   KEYS[5] the shard's paused hash
--   ARGV[1] thread id   ARGV[2] the most waiting members to read, first in release order (0 or
--   none: all; a thread of many thousands takes Redis as many records to read)
-- Returns {active as a flat field/value list, the waiting members read as a flat task id/score
--          list, the records of the active and waiting members read as a flat task id/record
--          list, the thread's score in the due index or "", {the pause's reason} or {},
--          the number of waiting members}.
local active = redis.call('HGETALL', KEYS[1])
local limit = tonumber(ARGV[2]) or 0
local queue = redis.call('ZRANGE', KEYS[2], 0, limit > 0 and limit - 1 or -1, 'WITHSCORES')
local total = limit > 0 and redis.call('ZCARD', KEYS[2]) or #queue / 2
local records = {}
for i = 1, #active, 2 do
  if active[i] == 'task' then
    local _, rec = find_member(KEYS[3], active[i + 1])
    if rec then
      records[#records + 1] = active[i + 1]
      records[#records + 1] = rec
    end
  end
end
local fields, waiting = {}, {}
for i = 1, #queue, 2 do fields[#fields + 1] = member_field(queue[i]) end
for start = 1, #fields, 1000 do    -- in chunks: unpack() is bounded by Lua's stack
  local stop = math.min(start + 999, #fields)
  local got = redis.call('HMGET', KEYS[3], unpack(fields, start, stop))
  for i = 1, #got do
    local k = start + i - 1
    -- (A queue member's record outlives its membership: '' never shows.)
    waiting[2 * k - 1] = got[i] and field_task(fields[k], got[i]) or ''
    waiting[2 * k] = queue[2 * k]
    if got[i] then
      records[#records + 1] = waiting[2 * k - 1]
      records[#records + 1] = got[i]
    end
  end
end
local paused = redis.call('HGET', KEYS[5], ARGV[1])
return { active, waiting, records, redis.call('ZSCORE', KEYS[4], ARGV[1]) or '',
         paused and { paused } or {}, total }
