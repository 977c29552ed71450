-- handback: a worker that is shutting down returns a released member it holds unstarted (in the
-- prefetch buffer of a queue consumed without broker acknowledgements, whose message the broker
-- will not redeliver), fenced by the release's token.
--   ARGV[6] task id   ARGV[7] token
-- The member stays RELEASED under the same token and its release deadline restarts; the caller
-- publishes it again at once (the first delivery to be claimed wins, so a copy the worker still
-- starts is harmless).  Returns {2, 'republish', task, token, record}, or {0, ''} when the member
-- no longer holds the thread under that token or has been claimed.
if is_active(ARGV[6], ARGV[7]) ~= 'RELEASED' then return reply(0, '') end
return republish_active(ARGV[6], ARGV[7], NOW + RELEASE_TIMEOUT)
