"""`python -m llmgw` runs the same CLI as the packaged executable."""

from llmgw.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
