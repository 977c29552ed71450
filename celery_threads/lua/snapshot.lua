-- snapshot: a consistent read of one thread (no writes), for inspection.
--   KEYS[1] active   KEYS[2] queue   KEYS[3] the shard's tasks hash   KEYS[4] the shard's due index
--   ARGV[1] thread id
-- Returns {active as a flat field/value list, queue as a flat member/score list,
--          the records of the active and waiting members as a flat task id/record list,
--          the thread's score in the due index or ""}.
local active = redis.call('HGETALL', KEYS[1])
local queue = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
local ids, fields = {}, {}
for i = 1, #active, 2 do
  if active[i] == 'task' then
    ids[#ids + 1] = active[i + 1]
    fields[#fields + 1] = task_field(active[i + 1])
  end
end
for i = 1, #queue, 2 do
  fields[#fields + 1] = member_field(queue[i])
  ids[#ids + 1] = field_task(fields[#fields])
end
local records = {}
for start = 1, #ids, 1000 do    -- in chunks: unpack() is bounded by Lua's stack
  local stop = math.min(start + 999, #ids)
  local got = redis.call('HMGET', KEYS[3], unpack(fields, start, stop))
  for i = 1, #got do
    if got[i] then
      records[#records + 1] = ids[start + i - 1]
      records[#records + 1] = got[i]
    end
  end
end
return { active, queue, records, redis.call('ZSCORE', KEYS[4], ARGV[1]) or '' }
