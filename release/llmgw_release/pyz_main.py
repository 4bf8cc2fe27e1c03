"""The release zipapp's `__main__.py`: the first code of llmgw that runs on an operator's machine.

It refuses, with a message that says what to do, a Python or a machine the artifact was not built
for (instead of an ImportError from deep inside cffi), then chooses where shiv unpacks the
artifact and hands over to shiv's bootstrap, which unpacks it once per build and runs
`llmgw.cli:main`.

Where it unpacks (SHIV_ROOT), unless SHIV_ROOT is set already:
  root (uid 0):   /var/cache/llmgw/pyz
  anyone else:    $XDG_CACHE_HOME/llmgw/pyz, default ~/.cache/llmgw/pyz
The directory is created 0700 and must belong to the user and be writable by no one else:
whoever can write there can replace the code llmgw runs. SHIV_ROOT stays set for child
processes, so an llmgw started by llmgw unpacks to the same place.

This file is copied into the artifact by the release build (which fills in MACHINES). It must
still parse on Python 3.6 (RHEL 8's python3) so that it gets the message, not a SyntaxError:
no annotations, walrus or match here.
"""

import os
import sys

SUPPORTED = ((3, 10), (3, 13))
MACHINES = ()  # `uname -m` values the artifact runs on; the build writes them here
EX_SOFTWARE = 70
EX_CONFIG = 78


def unpack_root(euid, environ):
    if euid == 0:
        return "/var/cache/llmgw/pyz"
    cache = environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(cache):  # the XDG spec says to ignore a relative value
        cache = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "llmgw", "pyz")


def refusal(version, machine, machines):
    """Why this artifact cannot run here, or None."""
    lo, hi = SUPPORTED
    if not lo <= tuple(version[:2]) <= hi:
        return (
            f"llmgw needs CPython {lo[0]}.{lo[1]} to {hi[0]}.{hi[1]}; this is Python "
            f"{version[0]}.{version[1]}.{version[2]} ({sys.executable}). "
            f"Run the file with a supported one, e.g. `python3.11 {sys.argv[0]}`."
        )
    if machines and machine not in machines:
        return f"this llmgw is built for {'/'.join(machines)}, but this machine is {machine}; download the artifact for {machine}."
    return None


def check_root(root, euid):
    """Create the unpack directory; a message if it is not safe to run code from."""
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        st = os.stat(root)
    except OSError as exc:
        return f"cannot create {root} to unpack llmgw into: {exc}; set SHIV_ROOT to a directory you own"
    if st.st_uid != euid or st.st_mode & 0o022:
        return (
            f"refusing to unpack llmgw into {root}: it belongs to uid {st.st_uid} with mode {st.st_mode & 0o7777:o}, "
            "so others could change the code llmgw runs; make it yours (chown, chmod go-w) or set SHIV_ROOT"
        )
    return None


def main():
    why = refusal(sys.version_info, os.uname().machine, MACHINES)
    if why:
        sys.stderr.write(f"llmgw: {why}\n")
        sys.exit(EX_SOFTWARE)
    if not os.environ.get("SHIV_ROOT"):
        euid = os.geteuid()
        root = unpack_root(euid, os.environ)
        why = check_root(root, euid)
        if why:
            sys.stderr.write(f"llmgw: {why}\n")
            sys.exit(EX_CONFIG)
        os.environ["SHIV_ROOT"] = root

    # shiv's bootstrap, next to this file in the zipapp (not a dependency of this source file).
    import _bootstrap  # pants: no-infer-dep

    _bootstrap.bootstrap()


if __name__ == "__main__":
    main()
