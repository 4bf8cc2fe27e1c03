"""What a test needs of the machine, said as a failure naming it and the fix, never as a skip.

`./pants test` provides all of it before the tests run (tools/testenv/prepare.py lists each
package and why); these messages are for a machine where that did not happen, e.g. a test run
outside Pants or a package removed since.
"""

from __future__ import annotations

import os
import shutil

import pytest

# sbin is not on a user's PATH on Debian, and some tools live there.
SYSTEM_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
FIX = "`./pants test` installs it when run as root, or prints the command; so does tools/testenv/prepare.py"


def missing_message(what: str, package: str) -> str:
    return f"{what} is missing: install the Debian package {package} (apt-get install {package}); {FIX}"


def find(name: str) -> str | None:
    if os.path.isabs(name):
        return name if os.access(name, os.X_OK) else None
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), *SYSTEM_DIRS]))


def program(name: str, package: str) -> str:
    """The path of `name`, or the test fails saying which package provides it."""
    found = find(name)
    if found is None:
        pytest.fail(missing_message(name, package))
    return found
