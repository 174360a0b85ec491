-- KEYS: the tenant's grants (`<settings>:grants`).
-- Reports every grant of the tenant's goals to its pool (they go on), so the pools' books are exact
-- when read. Returns how many were reported.
return report_all(KEYS[1], false)
