-- KEYS: goal books. ARGV: tenant key prefix (`Keys.tenant('')`).
-- Ends the goal's grant from its tenant's pool, if it holds one: reported, and what it holds beyond
-- the calls in flight given back (before the books are deleted). Returns 1 if it held one.
local tenant = redis.call('HGET', KEYS[1], 'tenant')
if not tenant then return 0 end
if report(KEYS[1], true, ARGV[1] .. tenant .. ':grants') then return 1 end
return 0
