-- enqueue: a new member joins the thread; it is released at once when it is due and the thread is idle.
--   ARGV[5] task id   ARGV[6] "at"|"in"   ARGV[7] scheduled_at ms ("at") or delay ms ("in")
--   ARGV[8] max_retries (-1: unlimited)   ARGV[9] retry delay ms   ARGV[10] envelope
-- Returns {1, ''} added (plus the release, if any), {0, ''} when the task id is already a member.
local released = add_member(ARGV[5], schedule(ARGV[6], ARGV[7]), 0, ARGV[8], ARGV[9], ARGV[10])
if released == false then return reply(0, '') end
return reply(1, '', released)
