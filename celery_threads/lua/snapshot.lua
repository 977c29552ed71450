-- snapshot: a consistent read of one thread (no writes), for inspection.
--   KEYS[1] active   KEYS[2] queue   KEYS[3] the shard's tasks hash   KEYS[4] the shard's due index
--   ARGV[1] thread id
-- Returns {active as a flat field/value list, queue as a flat member/score list,
--          records of the active member then of each waiting member (false when gone),
--          the thread's score in the due index or ""}.
local active = redis.call('HGETALL', KEYS[1])
local queue = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
local ids = {}
for i = 1, #active, 2 do
  if active[i] == 'task' then ids[#ids + 1] = active[i + 1] end
end
for i = 1, #queue, 2 do ids[#ids + 1] = string.sub(queue[i], 18) end
local records = {}
for start = 1, #ids, 1000 do    -- in chunks: unpack() is bounded by Lua's stack
  local got = redis.call('HMGET', KEYS[3], unpack(ids, start, math.min(start + 999, #ids)))
  for i = 1, #got do records[#records + 1] = got[i] end
end
return { active, queue, records, redis.call('ZSCORE', KEYS[4], ARGV[1]) or '' }
