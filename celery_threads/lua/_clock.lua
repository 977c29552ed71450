-- The gate's clock, prepended to every script (transitions and the dispatcher's scan).
-- `override` is "" to use the Redis server's TIME (always, outside the model-based test), else
-- milliseconds.  Returns milliseconds.
local function server_now_ms(override)
  if override ~= '' then return tonumber(override) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
