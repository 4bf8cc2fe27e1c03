"""Rewrite `from llmgw import pki` + `pki.NAME` into direct imports from llmgw.pki.{ca,files,tls,tlsdiag}.

For merging branches that still use the old `llmgw.pki` module: take their version of a file, then
    python pki_split_rewrite.py FILE... && ruff check --fix FILE... && ruff format FILE...
It rewrites `from llmgw import pki` and every `pki.NAME` into `from llmgw.pki.<module> import NAME`, and
the old method `ca.issue_server_cert(state_dir, ...)` into `issue_server_cert(ca, state_dir, ...)`.
It stops on a `pki.NAME` it does not know. Leaves files without `from llmgw import pki` alone.
"""

import re
import sys

MODULE = {}
for mod, names in {
    "ca": "CA CertInfo WrongKey cert_info cert_info_from_der parse_cert parse_key check_key_of check_issued_by "
    "check_node_id parse_san parse_sans new_ca new_key_pem make_key_and_csr make_csr CLOCK_SKEW DEFAULT_CA_NAME",
    "files": "CAPaths NodePaths ca_paths node_paths init_ca load_ca issue_server_cert issue_to_dir "
    "write_node_key_and_csr install_node_cert load_cert write_cert fs_errors STATE_DIR_WHAT CA_DIR_WHAT NODE_DIR_WHAT",
    "tls": "server_ssl_context client_ssl_context send_tls_alert ALERT_TIMEOUT_S",
    "tlsdiag": "describe_tls_failure Side",
}.items():
    for n in names.split():
        MODULE[n] = mod

REF = re.compile(r"(?<![\w.])pki\.(\w+)")
# `X.issue_server_cert(state, ...)` was a CA method; now files.issue_server_cert(ca, state, ...)
METHOD = re.compile(r"([\w.()]+(?:\([^()]*\))?)\.issue_server_cert\(")


def rewrite(text: str) -> str:
    used: dict[str, set[str]] = {}

    def method(m: re.Match) -> str:
        used.setdefault("files", set()).add("issue_server_cert")
        return f"issue_server_cert({m.group(1)}, "

    text = METHOD.sub(method, text)

    def ref(m: re.Match) -> str:
        name = m.group(1)
        if name not in MODULE:
            raise SystemExit(f"unknown name pki.{name}")
        used.setdefault(MODULE[name], set()).add(name)
        return name

    text = REF.sub(ref, text)
    lines = text.split("\n")
    out = []
    for line in lines:
        m = re.fullmatch(r"(\s*)from llmgw import (.*)", line)
        if m and "pki" in [x.strip() for x in m.group(2).split(",")]:
            indent = m.group(1)
            rest = [x.strip() for x in m.group(2).split(",") if x.strip() != "pki"]
            if rest:
                out.append(indent + "from llmgw import " + ", ".join(rest))
            for mod in sorted(used):
                out.append(f"{indent}from llmgw.pki.{mod} import " + ", ".join(sorted(used[mod])))
            used = {}
            continue
        out.append(line)
    if used:
        raise SystemExit(f"no `from llmgw import pki` line for {used}")
    return "\n".join(out)


for path in sys.argv[1:]:
    with open(path) as f:
        old = f.read()
    new = rewrite(old)
    if new != old:
        with open(path, "w") as f:
            f.write(new)
        print("rewrote", path)
