"""`python -m xckpt`: the `xckpt` command (`xckpt.cli`), for when the script is not on PATH."""

from xckpt.cli import main

raise SystemExit(main())
