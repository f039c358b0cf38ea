-- An import overwrites stored rows before it inserts new ones (an anonymized row frees the
-- source_ref a new row of the file takes), so a supersede chain may point at a row inserted a
-- statement later. The import defers this key to its commit; everything else still checks it at
-- once (INITIALLY IMMEDIATE).
ALTER TABLE memory_items ALTER CONSTRAINT memory_items_superseded_by_fkey DEFERRABLE INITIALLY IMMEDIATE;
