-- requeue: the active member re-enters WAITING (retry) at its old arrival order.
--   ARGV[6] task id   ARGV[7] token   ARGV[8] "at"|"in"   ARGV[9] ms   ARGV[10] retries
--   ARGV[11] new envelope, or "" to keep the stored one
-- Returns {1, ''} plus the release, or {0, ''} when (task, token) is not the active member.
-- Replayed (its reply lost), it returns the same while the member it released is active (see
-- replayed), or {1, ''} while the member waits (it was requeued).
local task, token = ARGV[6], ARGV[7]
if not is_active(task, token) then
  local again = replayed('r', task, token, '')
  if again then return again end
  local _, rec = find_member(K_TASKS, task)
  if rec then return reply(1, '') end
  return reply(0, '')
end
requeue_active(task, schedule(ARGV[8], ARGV[9]), ARGV[10], ARGV[11])
detached('r', task, token, 1, '')
return reply(1, '', release_head(true))
