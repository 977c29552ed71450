-- kill: the active member died (retries exhausted, final exception, time limit, rejected).
--   ARGV[6] task id   ARGV[7] token   ARGV[8] "1" keep in the dead-letter store, "0" drop
--   ARGV[9] meta json (thread_id, retries, exception, traceback, ...)
-- Returns {1, ''} plus the release, or {0, ''} when (task, token) is not the active member.
-- Replayed (its reply lost), it returns the same while the member it released is active (see
-- replayed), or {1, ''} once that one has moved on or when it released none (the member is in
-- the dead-letter store; without keep, it ended lately).
local task, token = ARGV[6], ARGV[7]
if not is_active(task, token) then
  local again = replayed('k', task, token, '')
  if again then return again end
  if (ARGV[8] == '1' and redis.call('HEXISTS', K_DEADREC, task) == 1)
      or (ARGV[8] ~= '1' and ended_lately(task)) then
    return reply(1, '')
  end
  return reply(0, '')
end
kill_active(task, ARGV[8] == '1', ARGV[9])
detached('k', task, token, 1, '')
return reply(1, '', release_head(true))
