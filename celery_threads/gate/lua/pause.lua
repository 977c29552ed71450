-- pause: an operator stops the releases of a thread's members (Threads.pause).
--   ARGV[6] reason (as given: the caller turns "no reason" into its own marker)
-- The thread's active member, if any, goes on to its end; new members still join; nothing of the
-- thread is released (release_idle) until resume.lua.  The pause is operator state: it stays,
-- in the shard's paused hash, whether or not the thread has members.  An idle thread leaves the
-- due index, so that a dispatcher's tick never reads it while it is paused.
-- Returns {1, ''} when the thread was not paused, else {0, ''} (its reason is replaced).
local new = redis.call('HSET', K_PAUSED, TID, ARGV[6])
redis.call('ZREM', K_DUE, TID)
return reply(new, '')
