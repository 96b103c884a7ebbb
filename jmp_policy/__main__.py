"""`python -m jmp_policy`: the `jmp-policy` command."""

import sys

from jmp_policy.app.cli import main

if __name__ == "__main__":
    sys.exit(main())
