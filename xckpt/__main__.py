"""`python -m xckpt`: the `xckpt` command (`xckpt.cli`), for when the script is not on PATH."""

from xckpt.cli import main

if __name__ == "__main__":  # importing the module (as tests/test_imports.py does) runs nothing
    raise SystemExit(main())
