-- forget: a dead letter of this thread leaves the dead-letter store (Threads.forget); a hold its
-- death made (on_death="hold") is lifted, and the thread goes on without it.
--   ARGV[6] task id
-- Returns {1, ''} plus the release, if any, or {0, ''} when it was not in the store.
local task = ARGV[6]
if redis.call('ZREM', K_DEAD, task) + redis.call('HDEL', K_DEADREC, task) == 0 then
  return reply(0, '')
end
if lift_hold(task) then return reply(1, '', release_head()) end
return reply(1, '')
