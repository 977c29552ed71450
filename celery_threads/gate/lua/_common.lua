-- Shared prelude, prepended to every gate script (one body, so transitions cannot drift).
--
-- KEYS (identical for every script; all carry the shard's hash tag):
--   KEYS[1] seq      STRING  shard counter: arrival order and fencing tokens
--   KEYS[2] due      ZSET    thread id -> head scheduled_at (ms); threads with no active member
--   KEYS[3] leases   ZSET    thread id -> deadline (ms) of the active member (release or lease)
--   KEYS[4] tasks    HASH    task id's field (_member.lua) -> record, every member (make_record)
--   KEYS[5] dead     ZSET    task id -> death order (a value of the shard counter)
--   KEYS[6] deadrec  HASH    task id -> died_at_ms "\n" meta_json "\n" envelope
--   KEYS[7] queue    ZSET    this thread's waiting members (seq, field) -> scheduled_at (ms)
--   KEYS[8] active   HASH    this thread's active member: task, token, state, since, deadline,
--                            worker, by (the claimant), n, f (l before it), prev and pst (see DETACHED),
--                            stop and del (see marked_deleted)
--   KEYS[9] ended    ZSET    task id -> ended_at (ms) of members that ended in the last
--                            ENDED_WINDOW; +inf: a UUID member keyed by its long form (add_member)
--   KEYS[10] paused  HASH    thread id -> reason, of each paused thread (pause.lua): nothing of
--                            it is released until resume.lua; while idle it is in no index
--   KEYS[11] stats   HASH    the shard's counters, kept by the transitions (metrics)
--   KEYS[12] policy  HASH    this thread's policy state: for coalesce/debounce 'c:<task name>'
--                            -> the task's latest call (enqueue.lua), 'w:<task id>' of a call
--                            not released yet and 'n' their count (expires ENDED_WINDOW after
--                            the last such call left the queue: left_waiting); for
--                            thread_rate_limit 'rl' the time of its last release of a member
--                            with a rate, 're' until when it counts (rate_wait)
-- ARGV (common head):
--   ARGV[1] now      "" to use the Redis server's TIME, else milliseconds (tests only)
--   ARGV[2] thread   thread id
--   ARGV[3] release_timeout_ms   how long a release may stay unclaimed before it is republished
--   ARGV[4] wake     pub/sub channel told when a future head becomes the shard's earliest
--   ARGV[5] direct   "" when the caller publishes releases, else "<gate db>|<broker db>|<broker
--                    key prefix>": the broker is kombu's Redis transport on this server, and a
--                    release whose message allows it is pushed onto its queue here (see
--                    publish_direct)
-- Script-specific ARGV start at ARGV[6].
-- Every reply is {status, info, [released_task, released_token, released_record]}, or, for a
-- release this script has published, {status, info, released_task, released_token, '', 1}, or,
-- for a release of the member an enqueue adds, {status, info, task, token, '', 2} (the caller
-- has its message; its retries are 0).

if redis.replicate_commands then pcall(redis.replicate_commands) end  -- Redis 6.2: TIME before writes

-- The call's context, set by begin(KEYS, ARGV) before a transition's body runs: as a script
-- (EVALSHA), once per call after these definitions; as a function of the library (FCALL, Redis
-- 7+, see gate.function_library), at the start of each call, the definitions made once when
-- the library loaded.
local K_SEQ, K_DUE, K_LEASES, K_TASKS, K_DEAD, K_DEADREC, K_Q, K_A, K_ENDED, K_PAUSED
local K_STATS, K_POLICY
-- NOW: the server's clock in ms (a number), NOW_TEXT the same as text, NOW_US_TEXT in µs (text).
-- A number passed to redis.call, or joined to a string, costs Redis a printf: the hot paths pass
-- text (these, int_text's and ms_text's).
local NOW, NOW_TEXT, NOW_US_TEXT, TID, RELEASE_TIMEOUT, WAKE, DIRECT
-- Whether this call has taken a value of the shard counter (next_seq).
local SEQ_TAKEN
-- Whether NOW is the Redis server's clock (else a test's, which Redis's key expiry cannot follow).
local SERVER_CLOCK
-- {keepalive ms, worker, claimant, stop}: a script whose caller runs what it releases (finish
-- with ARGV[9]) sets this, and the member it releases is claimed for that caller at once
-- (activate); stop '1': the caller's process can be stopped from outside (claim.lua ARGV[11]).
local CLAIM
-- {"<kind>|<task>|<token>|<caller>", status, info}: the active member this call (of kind: f
-- finish, k kill, r requeue, x fail, d delete) has detached and the reply it gives.  The member
-- the call then releases keeps them ('prev', 'pst'), so that the same call replayed (its reply
-- lost, the client sending it again) gets the same reply (see replayed).
local DETACHED
-- The call's own id (an ending script's last ARGV): the same for its replays, another for any
-- other call (a pool process's ending is sent again under its claim; the main process's report
-- of the same member is another call).  '' (a caller that names none): never taken for a replay.
local CALLER

local function begin(keys, argv)
  K_SEQ, K_DUE, K_LEASES, K_TASKS = keys[1], keys[2], keys[3], keys[4]
  K_DEAD, K_DEADREC, K_Q, K_A, K_ENDED = keys[5], keys[6], keys[7], keys[8], keys[9]
  K_PAUSED, K_STATS, K_POLICY = keys[10], keys[11], keys[12]
  NOW, NOW_TEXT, NOW_US_TEXT = server_clock(argv[1])
  SERVER_CLOCK = argv[1] == ''
  TID = argv[2]
  RELEASE_TIMEOUT = argv[3]   -- ms as text: a number where arithmetic needs it
  WAKE = argv[4]
  DIRECT = argv[5]
  CLAIM = nil
  DETACHED = nil
  CALLER = ''
  SEQ_TAKEN = false
end

-- Texts of small integers, each made once (per library load; per call as a script).
local SMALL = {}

-- An integer as text (%d: Lua's own number format would print 15 digits or more as '1e+14').
local function int_text(n)
  local text = SMALL[n]
  if text then return text end
  if type(n) == 'string' then return n end
  text = string.format('%d', n)
  if n >= 0 and n < 4096 then SMALL[n] = text end
  return text
end

-- A time in ms as text (NOW's without formatting it again; a text as it is).
local function ms_text(ms)
  if ms == NOW then return NOW_TEXT end
  if type(ms) == 'string' then return ms end
  return string.format('%d', ms)
end

-- Metrics: the shard's counters in K_STATS, kept by the transitions themselves, so a scrape is
-- a few O(1) reads (celery_threads.metrics).  Fields (each an integer, HINCRBY):
--   ended:succeeded, ended:dead, ended:deleted   members ended, once each (count_ending)
--   retries    attempts that re-entered their thread (a retry, a lost attempt with retries left)
--   lapses     leases of RUNNING members that lapsed (expire) or whose pool process was lost (fail)
--   running    active members RUNNING now (a gauge: +1 on a claim, -1 when it leaves RUNNING)
--   w:<ms>, w:inf, w:sum   the wait histogram: due (the member's scheduled_at) -> the claim that
--              starts its body, one bucket field per bound (not cumulative) and the sum in ms
-- Every count sits in the branch that changes the member, never in a replay's, so a call sent
-- again after its reply was lost counts nothing twice.
local function count(field, n)
  redis.call('HINCRBY', K_STATS, field, n or '1')
end

-- A member ended as `outcome`: 'succeeded', 'dead' or 'deleted' (deleted, purged, expired,
-- superseded: every transition that ends a member without running it to an end).  `n`: how many.
local function count_ending(outcome, n)
  count('ended:' .. outcome, n)
end

-- The wait histogram's bounds (ms), the same as celery_threads.metrics.WAIT_BUCKETS_MS.
local WAIT_BUCKETS = { 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000,
                       300000, 900000, 3600000 }
-- Their fields, 'w:<bound>' (written out: a function library's loading cannot call ipairs).
local WAIT_FIELDS = { 'w:5', 'w:10', 'w:25', 'w:50', 'w:100', 'w:250', 'w:500', 'w:1000', 'w:2500',
                      'w:5000', 'w:10000', 'w:30000', 'w:60000', 'w:300000', 'w:900000',
                      'w:3600000' }

-- The active member's body starts now (its claim): its wait from its due time `sched` (ms) is
-- counted once per release: `w` in the active hash marks it, so a member a worker gave back
-- unstarted (handback.lua ARGV[8]) and claims again is not counted twice.
local function observe_wait(sched)
  if not sched then return end
  local wait = math.max(0, NOW - tonumber(sched))
  local field = 'w:inf'
  for i, bound in ipairs(WAIT_BUCKETS) do
    if wait <= bound then
      field = WAIT_FIELDS[i]
      break
    end
  end
  redis.call('HINCRBY', K_STATS, field, '1')
  redis.call('HINCRBY', K_STATS, 'w:sum', int_text(wait))
end

-- How long an ended member's task id is remembered, so that an enqueue replayed after a lost reply
-- cannot make it a member again and run it twice.  Longer than the client's replays: its retries
-- give up 15 s after a call's first failure, and an attempt waits at most 5 s for its reply
-- (gate.make_client).
local ENDED_WINDOW = 30000
local ENDED_WINDOW_TEXT = '30000'

-- The shard counter's next value: arrival order, death order and fencing tokens.  Never below the
-- server's clock in microseconds, so that a counter whose last increments were lost (a crash with
-- appendfsync everysec, a failover without WAIT) cannot hand out a token again: the lost values
-- were below the clock's reading at the time, and the clock has moved on since.  A script takes
-- far more than a microsecond, so the counter follows the clock and stays within a few units of
-- it (a script's own increments).  The clock alone would not do: a step back of the server's
-- clock would make a thread's next token smaller.  Microseconds since 1970 stay below 2^53 (exact
-- in Lua's numbers) until the year 2255.  Returns the value as text.
-- One command each: a call's first value sets the counter to the clock and reads what it held
-- (SET .. GET, Redis 6.2+), which is below the clock but for a step back of the clock, or values
-- taken within a microsecond: then the counter goes on from what it held.  A call's later values
-- are increments of the one it set.
local function next_seq()
  if SEQ_TAKEN then return int_text(redis.call('INCR', K_SEQ)) end
  SEQ_TAKEN = true
  local held = redis.call('SET', K_SEQ, NOW_US_TEXT, 'GET')
  held = held and tonumber(held)
  if not held or held < tonumber(NOW_US_TEXT) then return NOW_US_TEXT end
  local n = string.format('%d', held + 1)
  redis.call('SET', K_SEQ, n)
  return n
end

-- A member's record, the value of its field in the shard's tasks hash (one hash entry per member
-- holds both the task id -> thread index and the stored message):
--   ["\2" .. the last two bytes of a UUID keyed by its first 14 (_member.lua)]
--   .. "seq|retries|max_retries|delay_ms|<length of thread id>[|<policy>|]\n" .. thread id
--   .. envelope
-- `tail` is nil for a record without those bytes.  The policy, only in a member's record whose
-- task or call sets one (a plain member's header is as before, so it pays nothing for them), is
-- a string of items: 'h' (on_death="hold"), 'r<ms>' (thread_rate_limit: the interval between
-- two releases), 'c' (a call made with coalesce or debounce that has not been released yet:
-- left_waiting).
local function parse_record(rec)
  local from, tail = 1, nil
  if string.byte(rec, 1) == 2 then from, tail = 4, string.sub(rec, 2, 3) end
  local nl = string.find(rec, '\n', from, true)
  local seq, retries, maxr, delay, tlen, policy = string.match(string.sub(rec, from, nl - 1),
    '^(%d+)|(%d+)|(-?%d+)|(%d+)|(%d+)|?([^|]*)|?$')
  local body_at = nl + 1 + tonumber(tlen)
  return { seq = seq, retries = tonumber(retries), maxr = tonumber(maxr), delay = tonumber(delay),
           thread = string.sub(rec, nl + 1, body_at - 1), body_at = body_at, tail = tail,
           policy = policy }
end

local function make_record(seq, retries, maxr, delay, envelope, tail, policy)
  return (tail and '\2' .. tail or '') .. seq .. '|' .. int_text(retries) .. '|' .. maxr .. '|' ..
    delay .. '|' .. int_text(#TID) .. ((policy and policy ~= '') and '|' .. policy .. '|' or '') ..
    '\n' .. TID .. envelope
end

-- The policy of a record ('' for none): a plain member's costs a find and a byte compare.
local function record_policy(rec)
  local nl = string.find(rec, '\n', string.byte(rec, 1) == 2 and 4 or 1, true)
  if string.byte(rec, nl - 1) ~= 124 then return '' end      -- 124: '|'
  return string.match(string.sub(rec, 1, nl - 1), '|([^|]*)|$')
end

-- The policy a member keeps once released: without 'c' (a call released once is never
-- superseded: a retry's, a restart's or a redrive's record is not marked, see left_waiting).
local function released_policy(policy)
  if not policy or policy == '' then return '' end
  return (string.gsub(policy, 'c', ''))
end

-- The thread's policy hash lives as long as its longest need: without an expiry while a call made
-- with coalesce or debounce waits ('n' above 0: enqueue.lua, left_waiting), else until the
-- later of its expiry, `ms` from now (a rate's interval, the replay window of coalescing
-- calls) and the rate's last release's end ('re', see rate_stamp), so that neither policy cuts
-- the other's state short: a wait without an expiry forgets the expiry a rate set before it.
local function keep_policy(ms)
  local f = redis.call('HMGET', K_POLICY, 'n', 're')
  if tonumber(f[1] or '0') > 0 then
    redis.call('PERSIST', K_POLICY)
    return
  end
  if f[2] then
    -- With a test's clock the key lives an hour of Redis's own time, as rate_stamp keeps it.
    local rate = SERVER_CLOCK and tonumber(f[2]) - NOW or 3600000
    if rate > ms then ms = rate end
  end
  if redis.call('PTTL', K_POLICY) < ms then redis.call('PEXPIRE', K_POLICY, ms) end
end

-- thread_rate_limit: when the member of `policy` may be released, if it must wait (else nil),
-- and its interval: its own interval after the thread's last release of a member with a rate,
-- while the policy hash remembers that release ('rl'; 're': until when, that member's own
-- interval after it: see rate_stamp).  So a thread whose tasks share a rate is spaced by it;
-- with mixed rates the member released applies its own, from a release still remembered.
local function rate_wait(policy)
  local every = tonumber(string.match(policy, 'r(%d+)'))
  if not every then return nil, nil end
  local last = redis.call('HMGET', K_POLICY, 'rl', 're')
  if last[1] and tonumber(last[2]) > NOW and tonumber(last[1]) + every > NOW then
    return tonumber(last[1]) + every, every
  end
  return nil, every
end

-- Remember a release of a member whose interval is `every` ms, for that long: then the policy
-- hash vanishes (no later release needs it).  With a test's clock the key lives an hour of
-- Redis's own time (its expiry cannot follow that clock); 're' says when it counts as gone.
local function rate_stamp(every)
  redis.call('HSET', K_POLICY, 'rl', string.format('%d', NOW),
    're', string.format('%d', NOW + every))
  keep_policy(SERVER_CLOCK and every or 3600000)
end

-- A pause made by on_death="hold" (hold_thread) is marked in its paused-hash value:
-- "\0<dead task id>\0<reason>".  An operator's reason cannot start with "\0" (Threads.pause
-- refuses it), so an operator's pause is never taken for a hold, and a pause the operator
-- made over a hold (its reason replaced) is the operator's.
local HOLD_MARK = '^%z[^%z]*%z'

-- on_death="hold": the dead member `task` pauses its thread (its death's reason shown as the
-- pause's), instead of the thread moving on.  An operator's pause already there is kept in
-- the reason's text; the thread is held (redrive, restart, forget of `task` or resume lift it).
local function hold_thread(task, meta_json)
  local ok, meta = pcall(cjson.decode, meta_json)
  local exception = ok and type(meta) == 'table' and meta.exception or nil
  local reason = 'on_death=hold: ' .. task .. ' died' ..
    (type(exception) == 'string' and ': ' .. exception or '')
  local before = redis.call('HGET', K_PAUSED, TID)
  if before then
    -- Paused already (an operator's pause, which stays until resume): the pause stays whose it
    -- is, its reason telling of the death too; the dead member's restart, redrive or forget
    -- does not lift it.
    redis.call('HSET', K_PAUSED, TID, before .. ' (then ' .. reason .. ')')
    return
  end
  redis.call('HSET', K_PAUSED, TID, '\0' .. task .. '\0' .. reason)
end

-- Lift the hold the death of `task` made, if the thread is paused by it (not by an operator,
-- nor by another member's death).  Returns whether it was.
local function lift_hold(task)
  local v = redis.call('HGET', K_PAUSED, TID)
  if not v or string.sub(v, 1, #task + 2) ~= '\0' .. task .. '\0' then return false end
  redis.call('HDEL', K_PAUSED, TID)
  return true
end

-- The policy a dead record's meta kept (kill_active), or nil.
local function dead_policy(meta_json)
  local ok, meta = pcall(cjson.decode, meta_json)
  if ok and type(meta) == 'table' and type(meta.policy) == 'string' and meta.policy ~= '' then
    return meta.policy
  end
  return nil
end

-- Whether an operator paused the thread (pause.lua): then nothing of it is released.
local function thread_paused()
  return redis.call('HEXISTS', K_PAUSED, TID) == 1
end

-- A call made with coalesce or debounce (enqueue.lua) waits under a record whose policy has 'c'
-- (see make_record) and a 'w:<task id>' field in the thread's policy hash (K_POLICY), where 'n'
-- counts such calls; a later call of its task may supersede it.  It stops being one when it
-- leaves the queue otherwise: released (activate), purged or deleted.  Once none is left the
-- hash expires ENDED_WINDOW later (a replayed call is still told what it superseded); a new
-- such call keeps it again.  A member released once is never superseded: the mark is not
-- written again (a retry's record, requeue_active, and a restart's or redrive's are unmarked),
-- so a member without the mark costs these paths one look at its record's header.
local function left_waiting(task, rec)
  if not string.find(record_policy(rec), 'c', 1, true) then return end
  redis.call('HDEL', K_POLICY, 'w:' .. task)
  if redis.call('HINCRBY', K_POLICY, 'n', -1) <= 0 then keep_policy(ENDED_WINDOW) end
end

-- Index a thread that has no active member: in due at its head's scheduled_at, or, when it has
-- no member left or is paused, in neither index (its queue, emptied, is gone already; a paused
-- thread is not due until resumed, so the dispatcher never reads it).  `detached`: the caller has
-- just detached the active member, so the thread sits in the leases index (not in due).  `head`:
-- the queue's head, as read by the caller; `paused`: whether the thread is paused.
local function index_idle(detached, head, paused)
  redis.call('ZREM', K_LEASES, TID)
  if head[1] == nil or paused then
    if not detached then redis.call('ZREM', K_DUE, TID) end
    return
  end
  redis.call('ZADD', K_DUE, head[2], TID)
  if tonumber(head[2]) > NOW then
    local first = redis.call('ZRANGE', K_DUE, '0', '0')
    if first[1] == TID then redis.call('PUBLISH', WAKE, head[2]) end
  end
end

-- Make `task`, a member outside the queue, the thread's active member: RELEASED under a new token.
-- `in_due`: the thread may sit in the due index (an idle thread with members).  `rec`: the
-- member's record, `field` its field.  Returns {task, token, record}.
-- With CLAIM set, the member is RUNNING at once, claimed for CLAIM's worker (as claim.lua does).
local function activate(task, field, sched, in_due, rec)
  left_waiting(task, rec)
  local token = next_seq()
  local deadline
  if CLAIM then
    deadline = ms_text(NOW + CLAIM[1])
    redis.call('HSET', K_A, 'task', task, 'token', token, 'state', 'RUNNING', 'since', NOW_TEXT,
      'deadline', deadline, 'sched', ms_text(sched), 'n', '0', 'f', field, 'claimed', NOW_TEXT,
      'worker', CLAIM[2], 'by', CLAIM[3], 'stop', CLAIM[4] or '', 'w', '1')
    count('running')
    observe_wait(sched)
  else
    deadline = ms_text(NOW + RELEASE_TIMEOUT)
    redis.call('HSET', K_A, 'task', task, 'token', token, 'state', 'RELEASED', 'since', NOW_TEXT,
      'deadline', deadline, 'sched', ms_text(sched), 'n', '0', 'f', field)
  end
  if DETACHED then
    redis.call('HSET', K_A, 'prev', DETACHED[1], 'pst', DETACHED[2] .. '|' .. DETACHED[3])
  end
  if in_due then redis.call('ZREM', K_DUE, TID) end
  redis.call('ZADD', K_LEASES, deadline, TID)
  return { task, token, rec }
end

-- Release the queue's head when it is due; the thread has no active member (`detached`: the
-- caller has just detached it).  `known`: {field, record} of a member the caller holds, saving
-- the read of its record when it is the head.  Returns {task, token, record} or nil.
-- Every release of a waiting member comes here: a paused thread releases nothing.
local function release_idle(detached, known)
  local head = redis.call('ZRANGE', K_Q, '0', '0', 'WITHSCORES')
  local paused = head[1] ~= nil and thread_paused()
  if head[1] == nil or paused or tonumber(head[2]) > NOW then
    index_idle(detached, head, paused)
    return nil
  end
  local field = member_field(head[1])
  local rec = known and known[1] == field and known[2] or redis.call('HGET', K_TASKS, field)
  local policy = record_policy(rec)
  if policy ~= '' then
    -- thread_rate_limit: a head whose turn comes early waits at its place; the thread sits in
    -- the due index at the earliest time allowed, when the dispatcher releases it.
    local wait, every = rate_wait(policy)
    if wait then
      index_idle(detached, { head[1], string.format('%d', wait) }, false)
      return nil
    end
    if every then
      rate_stamp(every)
      redis.call('ZREM', K_Q, head[1])
      local released = activate(field_task(field, rec), field, head[2], not detached, rec)
      -- Its claim stamps the thread's last release again (claim.lua): the next member's turn
      -- counts from when this one starts.
      redis.call('HSET', K_A, 'rl', every)
      return released
    end
  end
  redis.call('ZREM', K_Q, head[1])
  return activate(field_task(field, rec), field, head[2], not detached, rec)
end

-- Release the head when it is due and nothing is active.  `detached` as for index_idle.
local function release_head(detached)
  if not detached and redis.call('EXISTS', K_A) == 1 then return nil end
  return release_idle(detached)
end

local B64 = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/'

-- Standard base64 with padding.  Output codes are gathered in a table and turned into text
-- by string.char 4,000 at a time (no string per input triple).
local function base64(s)
  local codes = { string.byte(B64, 1, 64) }
  local byte, char, unpack = string.byte, string.char, unpack
  local n = #s
  local full = n - n % 3
  local parts, out, k = {}, {}, 0
  for i = 1, full, 3 do
    local a, b, c = byte(s, i, i + 2)
    local a4, b16, c64 = a % 4, b % 16, c % 64
    out[k + 1] = codes[(a - a4) / 4 + 1]
    out[k + 2] = codes[a4 * 16 + (b - b16) / 16 + 1]
    out[k + 3] = codes[b16 * 4 + (c - c64) / 64 + 1]
    out[k + 4] = codes[c64 + 1]
    k = k + 4
    if k == 4000 then
      parts[#parts + 1] = char(unpack(out, 1, k))
      k = 0
    end
  end
  local rest = n - full
  if rest > 0 then
    local a, b = byte(s, full + 1, n)
    b = b or 0
    local a4, b16 = a % 4, b % 16
    out[k + 1] = codes[(a - a4) / 4 + 1]
    out[k + 2] = codes[a4 * 16 + (b - b16) / 16 + 1]
    out[k + 3] = rest == 2 and codes[b16 * 4 + 1] or 61   -- 61: '='
    out[k + 4] = 61
    k = k + 4
  end
  parts[#parts + 1] = char(unpack(out, 1, k))
  return table.concat(parts)
end

-- Publish a release here, as kombu's Redis transport would (Producer.publish -> basic_publish
-- -> LPUSH of the JSON message onto the queue's list), when DIRECT names the broker and the
-- stored message allows it: the publisher marked it '{"d":<1|2>,"hl":<length of its headers>,...'
-- (default exchange, priority 0, no expiry, no compression; see publish.encode_envelope).  The
-- headers are spliced as stored, not decoded and encoded again.  A body marked 2 is UTF-8 text:
-- it goes in as a JSON string with body_encoding 'utf-8' (kombu's other body encoding, which its
-- consumer turns back into the same bytes), escaped by cjson in C: base64 in Lua costs far more
-- Redis CPU per byte.  Returns true when published.
local function publish_direct(token, rec)
  if DIRECT == '' then return false end
  local gate_db, broker_db, prefix = string.match(DIRECT, '^(%d+)|(%d+)|(.*)$')
  local p = parse_record(rec)
  local mark, hl = string.match(rec, '^{"d":([12]),"hl":(%d+),"headers":', p.body_at)
  local nl = hl and string.find(rec, '\n', p.body_at, true)
  if not nl then return false end
  local hs = p.body_at + 23 + #hl   -- where the headers' JSON object starts
  -- The rest of the header (after the headers, which are never decoded here).
  local ok, h = pcall(cjson.decode, '{' .. string.sub(rec, hs + tonumber(hl) + 1, nl - 1))
  if not ok or type(h.routing_key) ~= 'string' or type(h.properties) ~= 'table' then return false end
  local inner = string.sub(rec, hs + 1, hs + tonumber(hl) - 2)
  if inner ~= '' then inner = inner .. ',' end
  local props = h.properties
  props.delivery_info = { exchange = '', routing_key = h.routing_key }
  props.priority = 0
  -- kombu's Redis transport keys its unacked messages by this tag: unique across gates and time.
  props.delivery_tag = K_SEQ .. ':' .. token .. ':' .. NOW
  local body
  if mark == '2' then
    body = cjson.encode(string.sub(rec, nl + 1))
    props.body_encoding = 'utf-8'
  else
    body = '"' .. base64(string.sub(rec, nl + 1)) .. '"'
    props.body_encoding = 'base64'
  end
  local message = '{"body":' .. body .. ',"content-encoding":' ..
    cjson.encode(h.content_encoding) .. ',"content-type":' .. cjson.encode(h.content_type) ..
    ',"headers":{' .. inner .. '"retries":' .. p.retries .. ',"eta":null,"thread_id":' ..
    cjson.encode(TID) .. ',"thread_token":"' .. token .. '"},"properties":' ..
    cjson.encode(props) .. '}'
  -- pcall: a refused push (ACLs, a key of another type) leaves the publish to the caller.
  local switch = broker_db ~= gate_db
  if switch then
    local selected = redis.pcall('SELECT', broker_db)
    if type(selected) == 'table' and selected.err then return false end
  end
  local pushed = redis.pcall('LPUSH', prefix .. h.routing_key, message)
  if switch then redis.call('SELECT', gate_db) end
  return not (type(pushed) == 'table' and pushed.err)
end

-- `own`: the caller sent the released member's message (an enqueue releasing what it adds), so
-- the reply leaves its record out.
local function reply(status, info, released, own)
  if released == nil then return { status, info } end
  if publish_direct(released[2], released[3]) then
    return { status, info, released[1], released[2], '', 1 }
  end
  if own then return { status, info, released[1], released[2], '', 2 } end
  return { status, info, released[1], released[2], released[3] }
end

-- The state of the active member when it is `task`, whatever its token, else nil.
local function active_state(task)
  local a = redis.call('HMGET', K_A, 'task', 'state')
  if a[1] ~= task then return nil end
  return a[2]
end

-- The tasks-hash field of the active member `task`, given its 'f' (its field, written by
-- activate) or else its 'l' (written before 'f' was; nil in an active member written before
-- either, whose field is then looked for).
local function active_field(task, long, field)
  if field then return field end
  if long == '0' then return (task_field(task)) end
  if long == '1' then return '\1' .. task end
  return member_field_of(K_TASKS, task)
end

-- The state of the active member when it is (task, token), else nil: the fencing check.  Also
-- returns, from the same read, its 'l' and 'f' (for active_field), its claimant ('by', for
-- not_the_claimants) and whether it is marked deleted (for marked_deleted).  (claim.lua reads
-- the same fields with its own.)
local function is_active(task, token)
  local a = redis.call('HMGET', K_A, 'task', 'token', 'state', 'l', 'f', 'by', 'del')
  if a[1] ~= task or a[2] ~= token then return nil end
  return a[3], a[4], a[5] or nil, a[6] or '', a[7] == '1'
end

-- Whether a finish or requeue of the active member, in `state`, comes from another delivery than
-- the one that claimed it: a worker's ending names its claim as its caller (CALLER).  Both may
-- hold its token after the gate lost the first claim (a crash with appendfsync everysec, a
-- failover without WAIT) and another delivery claimed it again; the first worker's ending must
-- not end the second's run and release the next member beside it.  kill only when its caller says
-- it is the claimant (kill.lua ARGV[11]): a worker's main process and a producer kill a member
-- without knowing the claim.
-- `by`: the claimant, when the caller has read it (is_active).
local function not_the_claimants(state, by)
  if state ~= 'RUNNING' or CALLER == '' then return false end
  if by == nil then by = redis.call('HGET', K_A, 'by') end
  return by and by ~= '' and by ~= CALLER
end

-- Whether the active member is RUNNING under a claim another worker process made: its claimant
-- does not begin with `holder` (a process's claimant prefix, 'hostname/pid/').  A worker's main
-- process ends what its pool process ran with that process's prefix (it does not know the claim
-- itself), and with a prefix no claimant has ("\0") a message that no process started.
-- `by`: the claimant, when the caller has read it (is_active).
local function held_elsewhere(state, holder, by)
  if state ~= 'RUNNING' or not holder or holder == '' then return false end
  if by == nil then by = redis.call('HGET', K_A, 'by') end
  return by and by ~= '' and string.sub(by, 1, #holder) ~= holder
end

-- Publish the active RELEASED member `task` again under its `token`: its release deadline becomes
-- `deadline` (and its republish count `n`, when given).  Returns the reply for the caller to publish.
local function republish_active(task, token, deadline, n)
  if n then
    redis.call('HSET', K_A, 'deadline', deadline, 'n', n)
  else
    redis.call('HSET', K_A, 'deadline', deadline)
  end
  redis.call('ZADD', K_LEASES, deadline, TID)
  local _, rec = find_member(K_TASKS, task)
  return { 2, 'republish', task, token, rec }
end

-- A member left the gate for good: remember its task id for ENDED_WINDOW (and forget older ones).
-- The index itself vanishes ENDED_WINDOW after the last ending, unless it holds a +inf entry (a
-- live member's, add_member), which must stay while that member lives.
local function mark_ended(task)
  redis.call('ZADD', K_ENDED, NOW_TEXT, task)
  redis.call('ZREMRANGEBYSCORE', K_ENDED, '-inf', '(' .. int_text(NOW - ENDED_WINDOW))
  local last = redis.call('ZRANGE', K_ENDED, '-1', '-1', 'WITHSCORES')
  if last[2] == 'inf' then
    redis.call('PERSIST', K_ENDED)
  else
    redis.call('PEXPIRE', K_ENDED, ENDED_WINDOW_TEXT)
  end
end

-- Whether `task` ended (left the gate for good) within ENDED_WINDOW.
local function ended_lately(task)
  local at = redis.call('ZSCORE', K_ENDED, task)
  return at and at ~= 'inf' and tonumber(at) >= NOW - ENDED_WINDOW
end

-- The reply a call that detached the active member (task, token) gave, for the same call replayed
-- after its reply was lost, while the member it released is still active: that release again when
-- it is still RELEASED (the caller publishes it; a second copy loses the claim), or when it is
-- RUNNING for `claimant` (a finish that claimed it for its caller: then never a RELEASED one,
-- unless the finish ended a member marked deleted, which claims nothing); else the reply
-- without it.  nil when the active member was not released by such a call (none
-- is, or a later call released it).
local function replayed(kind, task, token, claimant)
  if CALLER == '' then return nil end
  local a = redis.call('HMGET', K_A, 'prev', 'pst', 'task', 'token', 'state', 'by', 'claimed')
  if a[1] ~= kind .. '|' .. task .. '|' .. token .. '|' .. CALLER then return nil end
  local status, info = string.match(a[2], '^(%d+)|(.*)$')
  status = tonumber(status)
  local mine = a[5] == 'RUNNING' and claimant ~= '' and a[6] == claimant
  if mine or (a[5] == 'RELEASED' and (claimant == '' or info == 'DELETED')) then
    local _, rec = find_member(K_TASKS, a[3])
    if mine then info = a[7] end
    return reply(status, info, { a[3], a[4], rec })
  end
  return reply(status, info)
end

-- Record what this call of `kind` detached (the active member (task, token)) and its reply.
local function detached(kind, task, token, status, info)
  DETACHED = { kind .. '|' .. task .. '|' .. token .. '|' .. CALLER, status, info }
end

-- Whether `task` is in the dead-letter store by this call (kill_active keeps the caller).
local function killed_by_caller(task)
  if CALLER == '' then return false end
  local rec = redis.call('HGET', K_DEADREC, task)
  if not rec then return false end
  local first = string.sub(rec, 1, (string.find(rec, '\n', 1, true) or 1) - 1)
  return string.match(first, '|(.*)$') == CALLER
end

-- Whether the active member was deleted while it ran and waits for its worker to stop it
-- (delete.lua ARGV[8] "3"): 'del' is set only on a RUNNING member whose claim said that its
-- process can be stopped from outside ('stop', a prefork pool process: claim.lua ARGV[11]).  The
-- next member is released only once that member's code has stopped: its worker's main process
-- ends it when its pool process has exited (delete.lua with its token).  Every other ending of
-- such a member ends it as deleted: no retry, no dead letter (finish, requeue, kill: info
-- DELETED; fail, expire, handback: DELETED_LAPSE).
-- `del`: whether it is, when the caller has read it (is_active).
local function marked_deleted(del)
  if del ~= nil then return del end
  return redis.call('HGET', K_A, 'del') == '1'
end
local DELETED_LAPSE = 5

-- The active member leaves the active hash (it ended, or waits again): one RUNNING fewer when
-- it ran (the 'running' count).  `state`: its state, when the caller has read it.
local function leave_active(state)
  if (state or redis.call('HGET', K_A, 'state')) == 'RUNNING' then count('running', '-1') end
  redis.call('DEL', K_A)
end

-- Detach the active member for good (it ended) and forget it.  `field`: its tasks-hash field
-- when the caller has it (else found from the task id), here and in the functions below;
-- `state` as for leave_active.
local function drop_active(task, field, state)
  leave_active(state)
  redis.call('HDEL', K_TASKS, field or member_field_of(K_TASKS, task))
  mark_ended(task)
end

-- Waiting again: the active member goes back to the queue at `sched` with its arrival order.
-- `field`, `rec`: where it is and its record, when the caller has read them.
local function requeue_active(task, sched, retries, envelope, field, rec)
  if not rec then field, rec = find_member(K_TASKS, task) end
  local p = parse_record(rec)
  if envelope == '' then envelope = string.sub(rec, p.body_at) end
  redis.call('HSET', K_TASKS, field, make_record(p.seq, retries, p.maxr, p.delay, envelope, p.tail,
    released_policy(p.policy)))
  redis.call('ZADD', K_Q, sched, queue_member(p.seq, field))
  leave_active()
end

-- The active member died: to the dead-letter store (when keep is true), detached, and counted
-- as a 'dead' ending either way.  A member with on_death="hold" holds its thread (hold_thread),
-- kept in the store or not.
local function kill_active(task, keep, meta_json, field, rec)
  if not rec then field, rec = find_member(K_TASKS, task) end
  local policy = released_policy(record_policy(rec))
  if policy ~= '' and string.find(policy, 'h', 1, true) then hold_thread(task, meta_json) end
  if keep then
    local p = parse_record(rec)
    -- Its place, for a redrive (redrive.lua): its arrival number and scheduled_at, added to the
    -- caller's meta (a JSON object); and its policy, which a redrive or restart keeps.
    local sched = redis.call('HGET', K_A, 'sched')
    local place = '"seq":' .. p.seq .. (sched and ',"sched":' .. sched or '') ..
      (policy ~= '' and ',"policy":' .. cjson.encode(policy) or '')
    if string.find(meta_json, '^{%s*}$') then
      meta_json = '{' .. place .. '}'
    elseif string.sub(meta_json, -1) == '}' then
      meta_json = string.sub(meta_json, 1, -2) .. ',' .. place .. '}'
    end
    -- Scored by the shard counter, so deaths in one millisecond keep their order.
    redis.call('ZADD', K_DEAD, next_seq(), task)
    -- The first line: when it died, and the call that killed it (killed_by_caller).
    local died = string.format('%d', NOW) .. (CALLER ~= '' and '|' .. CALLER or '')
    redis.call('HSET', K_DEADREC, task, died .. '\n' .. meta_json .. '\n' ..
      string.sub(rec, p.body_at))
  end
  count_ending('dead')
  drop_active(task, field)
end

-- A new arrival joins the thread, and is released at once when it is due and nothing is active.
-- Returns false when the task id is already a member (a duplicate spends an arrival number, which
-- only leaves a gap) or, unless `again` (a restart), ended in the last ENDED_WINDOW; else the
-- release ({task, token, record}) or nil.  `seq`: the arrival number it keeps (a redrive puts a
-- dead letter back at its place); it is then only queued, and the caller releases the head.
-- `policy`: its record's (make_record; nil or '' for none).  `cap` (max_waiting): returns
-- 'full' when the thread already has that many waiting members, after the checks above, so a
-- replayed call is told it was done, never refused.
local function add_member(task, sched, retries, maxr, delay, envelope, again, seq, policy, cap)
  local field, tail = task_field(task)
  if not again then
    -- One read refuses both an id that ended in the window and a UUID that is a member keyed by
    -- its long form (its short field was taken): such a member is in the ended index at +inf
    -- until it ends (below), so an enqueue does not look for that form in the tasks hash.
    local ended = redis.call('ZSCORE', K_ENDED, task)
    if ended and (ended == 'inf' or tonumber(ended) >= NOW - ENDED_WINDOW) then return false end
    if cap then
      local _, rec = find_member(K_TASKS, task)
      if rec then return false end
      if redis.call('ZCARD', K_Q) >= cap then return 'full' end
    end
  else
    if tail and redis.call('HEXISTS', K_TASKS, '\1' .. task) == 1 then return false end
    -- A restarted member is live again: a stale call of its ended run no longer finds it ended.
    redis.call('ZREM', K_ENDED, task)
  end
  local queued = seq ~= nil
  seq = seq or next_seq()
  local rec = make_record(seq, retries, maxr, delay, envelope, tail, policy)
  if redis.call('HSETNX', K_TASKS, field, rec) == 0 then
    if not tail or string.sub(redis.call('HGET', K_TASKS, field), 2, 3) == tail then
      return false
    end
    -- Another UUID with the same first 14 bytes holds the field: this one takes its long form.
    field, rec = '\1' .. task, make_record(seq, retries, maxr, delay, envelope, nil, policy)
    redis.call('HSET', K_TASKS, field, rec)
    redis.call('ZADD', K_ENDED, '+inf', task)     -- until it ends (mark_ended)
    redis.call('PERSIST', K_ENDED)
  end
  if queued or redis.call('EXISTS', K_A) == 1 then
    redis.call('ZADD', K_Q, sched, queue_member(seq, field))
    return nil
  end
  if sched <= NOW and not (policy and string.find(policy, 'r', 1, true))
      and redis.call('EXISTS', K_Q) == 0 and not thread_paused() then
    -- An empty thread (so in neither index): its only member is released without being queued
    -- (one with a thread_rate_limit goes the queue's way, where release_idle spaces it).
    return activate(task, field, sched, false, rec)
  end
  redis.call('ZADD', K_Q, sched, queue_member(seq, field))
  return release_idle(false, { field, rec })
end

-- The reply to an enqueue of a task id that is a member, or ended lately (`superseded`: what the
-- call superseded, for a replay of it; enqueue.lua).  Defined here, not in enqueue.lua, so that
-- the function library defines them once.
local function duplicate_enqueue(task, superseded)
  local a = redis.call('HMGET', K_A, 'task', 'token', 'state')
  if a[1] == task and a[3] == 'RELEASED' then
    local _, rec = find_member(K_TASKS, task)
    return reply(0, superseded, { task, a[2], rec })
  end
  return reply(0, superseded)
end

-- Whether the task id is a member, or ended within ENDED_WINDOW (add_member refuses both).
local function is_known(task)
  local _, rec = find_member(K_TASKS, task)
  if rec then return true end
  local at = redis.call('ZSCORE', K_ENDED, task)
  return at ~= false and (at == 'inf' or tonumber(at) >= NOW - ENDED_WINDOW)
end

local function schedule(mode, value)
  if mode == 'at' then return tonumber(value) end
  if value == '0' then return NOW end
  return NOW + tonumber(value)
end

-- A failed attempt of the active member (its worker was lost or its lease lapsed): it re-enters
-- after its retry delay while retries remain, else it dies with `reason`.
-- Returns 3 (retried) or 4 (died).
local function fail_active(task, reason)
  local field, rec = find_member(K_TASKS, task)
  local p = parse_record(rec)
  if p.maxr < 0 or p.retries < p.maxr then
    requeue_active(task, NOW + p.delay, p.retries + 1, '', field, rec)
    count('retries')
    return 3
  end
  local meta = cjson.encode({ thread_id = TID, retries = p.retries, exception = reason, traceback = '' })
  kill_active(task, true, meta, field, rec)
  return 4
end
