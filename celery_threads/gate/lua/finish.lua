-- finish: the active member succeeded (or ended without a result); it leaves and the next is released.
--   ARGV[6] task id   ARGV[7] token
--   ARGV[8] "1": the caller runs the release itself (in-process handoff): the script returns it
--           instead of publishing it, even where the gate publishes releases (optional)
--   ARGV[9] keepalive ms, ARGV[10] worker hostname, ARGV[11] claimant (optional, with ARGV[8]):
--           the released member is also claimed for the caller, RUNNING at once under its new
--           token (one round trip instead of two; the caller gives it back with handback's
--           ARGV[8] if it cannot run it)
--   ARGV[12] caller: the call's own id, the same when it is sent again (CALLER in _common.lua)
--   ARGV[13] "1": the caller's process can be stopped from outside (claim.lua ARGV[11]), for the
--            member claimed with ARGV[9] (optional)
-- A member marked deleted (marked_deleted) ends as deleted: {1, 'DELETED'} plus the next release,
-- never claimed for the caller (its worker is about to stop its process) and published here
-- where the gate publishes releases.
-- Returns {1, ''} plus the release ({1, now ms} plus the release when it was claimed), or {0, ''}
-- when (task, token) is not the active member, or is RUNNING for another claimant than the
-- caller.  Replayed (its reply lost), it returns the same while the member it released is active
-- (see replayed), or {1, ''} once that one has moved on or when it released none (the member
-- ended lately).
local task, token = ARGV[6], ARGV[7]
CALLER = ARGV[12] or ''
local claimant, direct = '', DIRECT
if ARGV[8] == '1' then
  DIRECT = ''
  if ARGV[9] and ARGV[9] ~= '' then
    claimant = ARGV[11] or ''
    CLAIM = { tonumber(ARGV[9]), ARGV[10], claimant, ARGV[13] or '' }
  end
end
local state, long, field, by, del = is_active(task, token)
if not state then
  local again = replayed('f', task, token, claimant)
  if again then return again end
  if ended_lately(task) then return reply(1, '') end
  return reply(0, '')
end
if not_the_claimants(state, by) then return reply(0, '') end
if marked_deleted(del) then
  CLAIM, DIRECT = nil, direct
  count_ending('deleted')
  drop_active(task, active_field(task, long, field))
  detached('f', task, token, 1, 'DELETED')
  return reply(1, 'DELETED', release_head(true))
end
count_ending('succeeded')
drop_active(task, active_field(task, long, field), state)
detached('f', task, token, 1, '')
local released = release_head(true)
return reply(1, (released and CLAIM) and NOW_TEXT or '', released)
