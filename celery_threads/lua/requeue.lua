-- requeue: the active member re-enters WAITING (retry) at its old arrival order.
--   ARGV[6] task id   ARGV[7] token   ARGV[8] "at"|"in"   ARGV[9] ms   ARGV[10] retries
--   ARGV[11] new envelope, or "" to keep the stored one
-- Returns {1, ''} plus the release, or {0, ''} when (task, token) is not the active member.
local task = ARGV[6]
if not is_active(task, ARGV[7]) then return reply(0, '') end
requeue_active(task, schedule(ARGV[8], ARGV[9]), ARGV[10], ARGV[11])
return reply(1, '', release_head(true))
