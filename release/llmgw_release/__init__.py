"""The release build: one zipapp per architecture that runs on CPython 3.10-3.13.

`build` is the entry point (`./pants run release:build -- --version X --out DIR`); `lock` reads
what to ship from the repository's requirements and lockfile; `wheels` fetches and merges the
wheels of every CPython minor; `zipapp` writes the archive. `pyz_main` and `pyz_preamble` are not
used by the build itself: they are copied into the artifact and run on the operator's machine.
"""
