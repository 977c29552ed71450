-- purge: drop waiting members of this thread, at most ARGV[6] per call, the last in release
-- order first: the head goes last, so the thread's place in the due index holds until its queue
-- is empty, and the active member (released or running) goes on.  A dropped member leaves the
-- gate as any ending does (its record, its queue entry, the ended index); the thread's keys
-- vanish with its last member.  Nothing is released.
--   ARGV[6] most members dropped by this call
-- Returns {1, how many still wait, {task ids dropped}, {task id, record, ...}}: the last, every
-- dropped member's record, its request in the result backend (its chord, an extended result,
-- the rpc:// backend's reply_to).
local limit = tonumber(ARGV[6])
local tail = redis.call('ZRANGE', K_Q, -limit, -1)
local dropped, records = {}, {}
for i = #tail, 1, -1 do
  local field = member_field(tail[i])
  local rec = redis.call('HGET', K_TASKS, field)
  if rec then
    local task = field_task(field, rec)
    left_waiting(task, rec)
    redis.call('HDEL', K_TASKS, field)
    mark_ended(task)
    dropped[#dropped + 1] = task
    records[#records + 1] = task
    records[#records + 1] = rec
  end
end
if #tail > 0 then redis.call('ZREMRANGEBYRANK', K_Q, -#tail, -1) end
if #dropped > 0 then count_ending('deleted', #dropped) end
local left = redis.call('ZCARD', K_Q)
if left == 0 and #tail > 0 and redis.call('EXISTS', K_A) == 0 then index_idle(false, {}) end
return { 1, left, dropped, records }
