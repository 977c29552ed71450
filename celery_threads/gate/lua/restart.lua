-- restart: a dead task re-enters its thread as a brand-new arrival (same task id, retries reset).
--   ARGV[6] task id   ARGV[7] max_retries   ARGV[8] retry delay ms
-- It keeps its policy (kept in the dead record's meta), and a hold its death made
-- (on_death="hold") is lifted.
-- Returns {1, ''} plus the release, {0, ''} when it is not in the dead-letter store,
-- {2, ''} when that task id is a member again already.
local task = ARGV[6]
local rec = redis.call('HGET', K_DEADREC, task)
if rec == false then return reply(0, '') end
local after_time = string.find(rec, '\n', 1, true)
local after_meta = string.find(rec, '\n', after_time + 1, true)
local released = add_member(task, NOW, 0, ARGV[7], ARGV[8], string.sub(rec, after_meta + 1), true,
  nil, dead_policy(string.sub(rec, after_time + 1, after_meta - 1)))
if released == false then return reply(2, '') end
redis.call('ZREM', K_DEAD, task)
redis.call('HDEL', K_DEADREC, task)
if lift_hold(task) then released = release_head() end
return reply(1, '', released)
