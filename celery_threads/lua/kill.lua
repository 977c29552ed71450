-- kill: the active member died (retries exhausted, final exception, time limit, rejected).
--   ARGV[6] task id   ARGV[7] token   ARGV[8] "1" keep in the dead-letter store, "0" drop
--   ARGV[9] meta json (thread_id, retries, exception, traceback, ...)
-- Returns {1, ''} plus the release, or {0, ''} when (task, token) is not the active member.
local task = ARGV[6]
if not is_active(task, ARGV[7]) then return reply(0, '') end
kill_active(task, ARGV[8] == '1', ARGV[9])
return reply(1, '', release_head(true))
