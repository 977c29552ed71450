-- fail: an attempt of the active member failed without its task deciding (the pool child running it
-- was killed): it re-enters after its retry delay while retries remain, else it dies.
--   ARGV[6] task id   ARGV[7] token   ARGV[8] reason, recorded when it dies
--   ARGV[9] caller: the call's own id, the same when it is sent again (CALLER in _common.lua)
--   ARGV[10] holder: the lost pool process's claimant prefix; refused while the member is
--            RUNNING under another process's claim (see held_elsewhere; optional)
-- Returns {3, task} retried, {4, task} died, or {5, task} ended as deleted (it was marked
-- deleted: marked_deleted), plus the next release; {0, ''} when (task, token)
-- is not the active member (or is RUNNING under another process's claim).  Replayed (its reply lost), it returns the same while the member it
-- released is active (see replayed), or {4, task} when this call killed it (else {0, ''}: the
-- worker's report of a pool process it lost must not count what the process reported itself).
local task, token = ARGV[6], ARGV[7]
CALLER = ARGV[9] or ''
local state, long, field, by, del = is_active(task, token)
if state ~= 'RUNNING' then
  if state then return reply(0, '') end
  local again = replayed('x', task, token, '')
  if again then return again end
  if killed_by_caller(task) then return reply(4, task) end
  return reply(0, '')
end
if held_elsewhere(state, ARGV[10], by) then return reply(0, '') end
local status = DELETED_LAPSE
-- A lost pool process counts as a lapse (its lease would have lapsed), unless its worker
-- stopped it because the member was deleted.
if marked_deleted(del) then
  count_ending('deleted')
  drop_active(task, active_field(task, long, field))
else
  count('lapses')
  status = fail_active(task, ARGV[8])
end
detached('x', task, token, status, task)
return reply(status, task, release_head(true))
