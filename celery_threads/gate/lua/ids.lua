-- ids: one page of a shard's thread ids (no writes), for Threads.ids() and `celery threads ls`.
-- Both indexes are read from one ZSCAN cursor in one atomic step, so a thread moving between them
-- (released, or back to idle) is in one of the two replies.
--   KEYS[1] due      ZSET  thread id -> head scheduled_at (ms)
--   KEYS[2] leases   ZSET  thread id -> deadline (ms)
--   ARGV[1] cursor   the ZSCAN cursor both indexes resume from ("0" to start)
--   ARGV[2] count    ZSCAN's COUNT
-- Returns {due's ZSCAN reply, leases' ZSCAN reply}: each {next cursor, {id, score, id, score...}}.
return { redis.call('ZSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2]),
         redis.call('ZSCAN', KEYS[2], ARGV[1], 'COUNT', ARGV[2]) }
