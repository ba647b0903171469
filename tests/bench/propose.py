"""Apply the proposed PARKED_SQL change (OFFSET 0 in the lateral that fetches the latest
checkpoint) to a COPY of custody at DIR, and rename the package so that its build shares the
dependencies but not custody's own artifacts. Exit 1 when src/ already has it (nothing to time).

  propose.py DIR
"""

import sys
from pathlib import Path

root = Path(sys.argv[1])
pg = root / "src/checkpoint/postgres.rs"
s = pg.read_text()
old = "x.checkpoint_id = l.checkpoint_id\n) c"
if s.count(old) != 1:
    sys.exit(1)
pg.write_text(s.replace(old, "x.checkpoint_id = l.checkpoint_id\n    OFFSET 0\n) c"))
toml = root / "Cargo.toml"
t = toml.read_text()
t = t.replace('name = "custody"\nversion', 'name = "custody-proposed"\nversion', 1)
t = t.replace('[lib]\npath = "src/lib.rs"', '[lib]\nname = "custody"\npath = "src/lib.rs"', 1)
t = t.replace('default-run = "custody"\n', "")
toml.write_text(t)
