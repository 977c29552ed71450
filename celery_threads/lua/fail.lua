-- fail: an attempt of the active member failed without its task deciding (the pool child running it
-- was killed): it re-enters after its retry delay while retries remain, else it dies.
--   ARGV[6] task id   ARGV[7] token   ARGV[8] reason, recorded when it dies
-- Returns {3, task} retried or {4, task} died, plus the next release; {0, ''} when (task, token)
-- is not the active member.  Replayed (its reply lost), it returns the same while the member it
-- released is active (see replayed), else {3, task} while the member waits, {4, task} when it
-- ended lately.
local task, token = ARGV[6], ARGV[7]
local state = is_active(task, token)
if state ~= 'RUNNING' then
  if state then return reply(0, '') end
  local again = replayed('x', task, token, '')
  if again then return again end
  local _, rec = find_member(K_TASKS, task)
  if rec then return reply(3, task) end
  if ended_lately(task) then return reply(4, task) end
  return reply(0, '')
end
local status = fail_active(task, ARGV[8])
detached('x', task, token, status, task)
return reply(status, task, release_head(true))
