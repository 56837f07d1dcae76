"""A process holding a shared region: `python shm_holder.py create|attach SHM_DIR NAME [SIZE]`.

Prints `@@ READY <size>` once the region is mapped (and so locked), then answers commands:
  READ <offset> <n>        -> `@@ <hex bytes>`
  WRITE <offset> <hex>     -> `@@ OK`
On end of stdin it closes the region (and unlinks it when it created it) and exits.
"""

from __future__ import annotations

import sys

from kvhandoff.adapters.shm.region import SharedRegion


def say(line: str) -> None:
    sys.stdout.write("@@ " + line + "\n")
    sys.stdout.flush()


def main() -> None:
    mode, shm_dir, name = sys.argv[1:4]
    if mode == "create":
        region = SharedRegion.create(name, int(sys.argv[4]), shm_dir=shm_dir)
    else:
        region = SharedRegion.attach(name, shm_dir=shm_dir)
    say(f"READY {region.size}")
    view = region.buffer()
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "READ":
            offset, count = int(args[0]), int(args[1])
            say(bytes(view[offset : offset + count]).hex())
        elif cmd == "WRITE":
            data = bytes.fromhex(args[1])
            view[int(args[0]) : int(args[0]) + len(data)] = data
            say("OK")
    view.release()
    region.close()
    if mode == "create":
        region.unlink()


if __name__ == "__main__":
    main()
