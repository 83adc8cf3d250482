"""`torchrun ... -m cocosync.shadowsync [train options]`: one rank of a ShadowSync job (cli/rank.py)."""

import sys

from cocosync.shadowsync.cli.rank import main

if __name__ == "__main__":
    sys.exit(main())
