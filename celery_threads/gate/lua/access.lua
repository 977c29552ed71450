-- access: the gate's rights, tried.  Runs each command the transitions run (lua/*.lua), on keys
-- and a channel of the gate's own, so that an ACL user missing one is told at start which.
--   KEYS[1] a ZSET, KEYS[2] a HASH, KEYS[3] a STRING: probe keys in the gate's prefix, deleted
--           at the end (<prefix>:{access}:z|h|s)
--   ARGV[1] a pub/sub channel in the gate's prefix that nobody listens to
-- Returns a flat array {command, error, command, error, ...} of the calls Redis refused.
local refused = {}
local function try(name, ...)
  local reply = redis.pcall(name, ...)
  if type(reply) == 'table' and reply.err then
    refused[#refused + 1] = string.lower(name)
    refused[#refused + 1] = reply.err
  end
end
local z, h, s = KEYS[1], KEYS[2], KEYS[3]
try('TIME')
try('ZADD', z, 1, 'p')
try('ZSCORE', z, 'p')
try('ZRANGE', z, 0, -1)
try('ZRANGEBYSCORE', z, '-inf', '+inf')
try('ZCARD', z)
try('ZREM', z, 'p')
try('ZREMRANGEBYSCORE', z, '-inf', '+inf')
try('HSET', h, 'f', 'v')
try('HSETNX', h, 'g', 'v')
try('HGET', h, 'f')
try('HMGET', h, 'f', 'g')
try('HGETALL', h)
try('HEXISTS', h, 'f')
try('HDEL', h, 'g')
try('INCR', s)
try('PEXPIRE', s, 60000)
try('PERSIST', s)
try('EXISTS', s)
try('PUBLISH', ARGV[1], '')
try('DEL', z, h, s)
return refused
