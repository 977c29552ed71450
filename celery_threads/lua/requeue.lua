-- requeue: the active member re-enters WAITING (retry) at its old arrival order.
--   ARGV[5] task id   ARGV[6] token   ARGV[7] "at"|"in"   ARGV[8] ms   ARGV[9] retries
--   ARGV[10] new envelope, or "" to keep the stored one
-- Returns {1, ''} plus the release, or {0, ''} when (task, token) is not the active member.
local task = ARGV[5]
if not is_active(task, ARGV[6]) then return reply(0, '') end
requeue_active(task, schedule(ARGV[7], ARGV[8]), ARGV[9], ARGV[10])
return reply(1, '', release_head(true))
