-- finish: the active member succeeded (or ended without a result); it leaves and the next is released.
--   ARGV[6] task id   ARGV[7] token
--   ARGV[8] "1": the caller runs the release itself (in-process handoff): the script returns it
--           instead of publishing it, even where the gate publishes releases (optional)
--   ARGV[9] keepalive ms, ARGV[10] worker hostname (optional, with ARGV[8]): the released member is
--           also claimed for the caller, RUNNING at once under its new token (one round trip
--           instead of two; the caller gives it back with handback's ARGV[8] if it cannot run it)
-- Returns {1, ''} plus the release ({1, now ms} plus the release when it was claimed), or {0, ''}
-- when (task, token) is not the active member.
local task = ARGV[6]
local state, long = is_active(task, ARGV[7])
if not state then return reply(0, '') end
if ARGV[8] == '1' then
  DIRECT = ''
  if ARGV[9] and ARGV[9] ~= '' then CLAIM = { tonumber(ARGV[9]), ARGV[10] } end
end
drop_active(task, active_field(task, long))
local released = release_head(true)
return reply(1, (released and CLAIM) and tostring(NOW) or '', released)
