"""A bounded window in Redis: a sorted set of (member, time) that admits a member only while it holds fewer than a
limit, in one atomic step. The generation gateway's rate limit and queue slots and the per-tenant upload slots
share it."""

from __future__ import annotations

from redis.asyncio import Redis

# KEYS[1]: a sorted set of (member, time); ARGV: now, horizon, limit, member, ttl. Drops entries older than the
# horizon (leftovers of a crashed API process); below the limit adds the member and returns nil, else returns the
# oldest entry's time.
_TAKE = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[1]) - tonumber(ARGV[2]))
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[3]) then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return oldest[2] or ARGV[1]
end
redis.call('ZADD', KEYS[1], ARGV[1], ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[5])
return false
"""


async def take(redis: Redis, key: str, *, member: str, now: float, horizon: float, limit: int) -> float | None:
    """Add `member` to the bounded window `key` in one atomic step; None if taken, else the oldest entry's time.

    A check followed by an add in separate calls lets a concurrent burst interleave: every request adds
    itself, every one then sees the set over the bound, and all are refused.
    """
    args = (str(now), str(horizon), str(limit), member, str(int(horizon) + 1))
    oldest = await redis.eval(_TAKE, 1, key, *args)  # type: ignore[misc]
    return None if oldest is None else float(oldest)
