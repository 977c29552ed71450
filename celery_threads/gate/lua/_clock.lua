-- The gate's clock, prepended to every script (transitions and the dispatcher's scan).
-- `override` is "" to use the Redis server's TIME (always, outside the model-based test), else
-- milliseconds.  Returns milliseconds, and the same reading in microseconds (the shard counter's
-- floor, see next_seq in _common.lua).
local function server_clock(override)
  if override ~= '' then
    local ms = tonumber(override)
    return ms, ms * 1000
  end
  local t = redis.call('TIME')
  local us = tonumber(t[1]) * 1000000 + tonumber(t[2])
  return (us - us % 1000) / 1000, us
end

local function server_now_ms(override)
  return (server_clock(override))
end
