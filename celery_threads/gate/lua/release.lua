-- release: the dispatcher's due-head release for one thread (a no-op unless the head is due and
-- the thread is idle; safe under concurrent dispatchers).
-- Returns {1, ''} plus the release, if any.
return reply(1, '', release_head())
