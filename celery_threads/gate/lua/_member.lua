-- How a member's task id is keyed: its field in the shard's tasks hash, and its member in the
-- thread's queue.
--
-- Field: a Celery task id (a lowercase UUID) as the first 14 of its 16 bytes, its record starting
-- with \2 and the last two (make_record); any other id as written when it is shorter than 14 bytes,
-- else behind a \1 byte.  A UUID whose 14 bytes another member's UUID holds already (they share
-- their first 28 hex digits) is keyed by its long form, \1 and its text, so a lookup checks the
-- record's two bytes (find_member).  The forms never meet (14 bytes, fewer, more), and a UUID's
-- field fits jemalloc's 16-byte allocation: 14 bytes plus Redis's one-byte header and NUL (16
-- bytes would take a 32-byte one).
-- Queue member: <n: one byte, 1-7> <seq: n bytes, big-endian> <field>.  The byte order of members
-- is their arrival order (members with equal scores sort by bytes): 22 bytes for a UUID and a seq
-- of 7 bytes (it follows the clock in microseconds, next_seq), where "<16-digit seq>:<uuid>" took 53.
-- celery_threads.gate reads both in Python (task_field, find_record, record_task, member_field).
local UUID_FORM = '^%x%x%x%x%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%-%x%x%x%x%x%x%x%x%x%x%x%x$'
local UUID_TEXT = '%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x'

-- The four bytes of a 32-bit number, big-endian.
local function split4(v)
  local d = v % 256
  v = (v - d) / 256
  local c = v % 256
  v = (v - c) / 256
  local b = v % 256
  return (v - b) / 256, b, c, d
end

-- The short field of a task id, and for a UUID the two bytes its record keeps (else nil).
local function task_field(task)
  -- (string.lower: the form admits A-F; a new string only when the id has capitals.)
  if #task == 36 and string.find(task, UUID_FORM) and string.lower(task) == task then
    local sub = string.sub
    local a1, a2, a3, a4 = split4(tonumber(sub(task, 1, 8), 16))
    local b1, b2, b3, b4 = split4(tonumber(sub(task, 10, 13) .. sub(task, 15, 18), 16))
    local c1, c2, c3, c4 = split4(tonumber(sub(task, 20, 23) .. sub(task, 25, 28), 16))
    local d1, d2, d3, d4 = split4(tonumber(sub(task, 29, 36), 16))
    return string.char(a1, a2, a3, a4, b1, b2, b3, b4, c1, c2, c3, c4, d1, d2), string.char(d3, d4)
  end
  if #task < 14 then return task end
  return '\1' .. task
end

-- The task id of a field, given its record (a 14-byte field's record holds the id's last bytes).
local function field_task(field, rec)
  if #field == 14 then
    return string.format(UUID_TEXT, string.byte(field .. string.sub(rec, 2, 3), 1, 16))
  end
  if #field < 14 then return field end
  return string.sub(field, 2)
end

-- The field of `task`, known to be a member: as find_member, without reading its record.
local function member_field_of(tasks, task)
  local field, tail = task_field(task)
  if tail and redis.call('HEXISTS', tasks, '\1' .. task) == 1 then return '\1' .. task end
  return field
end

-- Where `task` is a member: its field and record (the record false when it is not a member).
local function find_member(tasks, task)
  local field, tail = task_field(task)
  local rec = redis.call('HGET', tasks, field)
  if not tail or (rec and string.sub(rec, 2, 3) == tail) then return field, rec end
  field = '\1' .. task
  return field, redis.call('HGET', tasks, field)
end

local function queue_member(seq, field)
  seq = tonumber(seq)
  local digits = {}
  while seq > 0 do
    table.insert(digits, 1, seq % 256)
    seq = (seq - seq % 256) / 256
  end
  return string.char(#digits, unpack(digits)) .. field
end

local function member_field(member)
  return string.sub(member, string.byte(member, 1) + 2)
end
