-- resume: the releases of a paused thread go on at once (Threads.resume).
-- The thread's due head, when nothing is active, is released here (as every release is: the
-- caller publishes it), else the thread goes back into the due index at its head's time.
-- Returns {1, ''} plus the release, if any, when the thread was paused; else {0, ''}.
if redis.call('HDEL', K_PAUSED, TID) == 0 then return reply(0, '') end
return reply(1, '', release_head())
