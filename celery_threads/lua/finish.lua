-- finish: the active member succeeded (or ended without a result); it leaves and the next is released.
--   ARGV[6] task id   ARGV[7] token
--   ARGV[8] "1": the caller runs the release itself (in-process handoff): the script returns it
--           instead of publishing it, even where the gate publishes releases (optional)
-- Returns {1, ''} plus the release, or {0, ''} when (task, token) is not the active member.
local task = ARGV[6]
if not is_active(task, ARGV[7]) then return reply(0, '') end
if ARGV[8] == '1' then DIRECT = '' end
drop_active(task)
return reply(1, '', release_head(true))
