-- kill: the active member died (retries exhausted, final exception, time limit, rejected).
--   ARGV[5] task id   ARGV[6] token   ARGV[7] "1" keep in the dead-letter store, "0" drop
--   ARGV[8] meta json (thread_id, retries, exception, traceback, ...)
-- Returns {1, ''} plus the release, or {0, ''} when (task, token) is not the active member.
local task = ARGV[5]
if not is_active(task, ARGV[6]) then return reply(0, '') end
kill_active(task, ARGV[7] == '1', ARGV[8])
return reply(1, '', release_head(true))
