-- fail: an attempt of the active member failed without its task deciding (the pool child running it
-- was killed): it re-enters after its retry delay while retries remain, else it dies.
--   ARGV[6] task id   ARGV[7] token   ARGV[8] reason, recorded when it dies
-- Returns {3, task} retried or {4, task} died, plus the next release; {0, ''} when (task, token)
-- is not the active member.
local task = ARGV[6]
if is_active(task, ARGV[7]) ~= 'RUNNING' then return reply(0, '') end
return reply(fail_active(task, ARGV[8]), task, release_head(true))
