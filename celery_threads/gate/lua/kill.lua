-- kill: the active member died (retries exhausted, final exception, time limit, rejected).
--   ARGV[6] task id   ARGV[7] token   ARGV[8] "1" keep in the dead-letter store, "0" drop
--   ARGV[9] meta json (thread_id, retries, exception, traceback, ...)
--   ARGV[10] caller: the call's own id, the same when it is sent again (CALLER in _common.lua)
--   ARGV[11] "1": the caller is the member's claimant (a worker's ending of the member it ran),
--            and the kill is refused while the member is RUNNING for another claimant (after a
--            lost claim); else unfenced: the worker's main process (a message it cannot run) and
--            a producer do not know the claim (optional)
--   ARGV[12] holder: a worker process's claimant prefix; refused while the member is RUNNING
--            under another process's claim (see held_elsewhere; optional)
-- Returns {1, ''} plus the release, or {0, ''} when (task, token) is not the active member (or,
-- fenced, is RUNNING for another claimant or another process); {1, 'DELETED'} plus the release
-- when the member was marked deleted (marked_deleted): it ends as deleted, not dead.
-- Replayed (its reply lost), it returns the same while the member it released is active (see
-- replayed), or {1, ''} once that one has moved on or when it released none (the member is in
-- the dead-letter store by this call; one dropped without keep is not told from another's kill).
local task, token = ARGV[6], ARGV[7]
CALLER = ARGV[10] or ''
local state, long, field, by, del = is_active(task, token)
if not state then
  local again = replayed('k', task, token, '')
  if again then return again end
  if killed_by_caller(task) then return reply(1, '') end
  return reply(0, '')
end
if ARGV[11] == '1' and not_the_claimants(state, by) then return reply(0, '') end
if held_elsewhere(state, ARGV[12], by) then return reply(0, '') end
if marked_deleted(del) then
  count_ending('deleted')
  drop_active(task, active_field(task, long, field))
  detached('k', task, token, 1, 'DELETED')
  return reply(1, 'DELETED', release_head(true))
end
kill_active(task, ARGV[8] == '1', ARGV[9])
detached('k', task, token, 1, '')
return reply(1, '', release_head(true))
