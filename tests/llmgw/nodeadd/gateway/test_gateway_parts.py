"""The pure parts of `llmgw gateway add`: its steps, the unit it writes, what it takes as
arguments and what "joined" means for a gateway. Against a scripted machine:
test_gateway_identity.py; against a real one under systemd: tests/integration/test_gateway_add_systemd.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import trio
from trio.testing import MockClock

from llmgw.commands import gateway as gateway_command
from llmgw.errors import PeerError, UsageError
from llmgw.gatewayd import identity as gatewayd_identity
from llmgw.nodeadd import ssh
from llmgw.nodeadd.gateway import install, layout
from llmgw.nodeadd.gateway.steps import NAMES, STEPS
from llmgw.nodeadd.screen import _Screen, summary_lines
from llmgw.nodeadd.steps import FAILED, OK, STARTED, Checklist, Event, plain_line
from testlib.needs import program
from testlib.proc import build_root

UNIT_ARGS = {"server": "wss://10.0.0.1:7443", "listen": "0.0.0.0:8080", "workers": "2", "name": "gw1"}

# -- the steps -----------------------------------------------------------------------------


def test_the_authority_is_read_first_and_the_release_runs_before_anything_is_installed() -> None:
    assert NAMES[:2] == ("authority", "connect")
    assert NAMES.index("ship") < NAMES.index("install") < NAMES.index("identity") < NAMES.index("start")
    assert NAMES[-1] == "join"


def test_node_adds_checklist_and_lines_run_the_gateways_steps() -> None:
    c = Checklist(steps=STEPS)
    for name in NAMES:
        c.apply(Event(step=name, status=STARTED))
        c.apply(Event(step=name, status=OK))
    assert c.done and c.failed is None
    with pytest.raises(ValueError, match="unknown step 'doctor'"):
        Checklist(steps=STEPS).apply(Event(step="doctor", status=STARTED))
    line = plain_line(Event(step="join", status=OK, detail="linked"), STEPS)
    assert line == "ok     join       wait for the control plane to list the gateway connected: linked"
    assert all(len(name) <= 10 for name in NAMES)  # the lines' column


def test_node_adds_screen_draws_the_gateways_steps() -> None:
    c = Checklist(steps=STEPS)
    c.apply(Event(step="authority", status=STARTED))
    c.apply(Event(step="authority", status=OK, detail="CA 'llmgw cluster CA'"))
    c.apply(Event(step="connect", status=STARTED))
    c.apply(Event(step="connect", status=FAILED, detail="root@10.0.0.31: host key changed\nsee known_hosts"))
    lines = summary_lines("llmgw gateway add root@10.0.0.31", c)
    assert lines[:5] == [
        "llmgw gateway add root@10.0.0.31",
        "ok      read the certificate authority and the gateways connected",
        "failed  connect over SSH and verify the host key",
        "        root@10.0.0.31: host key changed",
        "        see known_hosts",
    ]
    assert lines[-1] == "pending wait for the control plane to list the gateway connected"
    assert list(_Screen("llmgw gateway add", STEPS).rows) == list(NAMES)


# -- the unit ------------------------------------------------------------------------------


def test_the_unit_runs_the_gateway_as_its_user_with_the_given_flags() -> None:
    unit = layout.systemd_unit(**UNIT_ARGS)
    service = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert service["ExecStart"] == (
        "/usr/local/bin/llmgw gateway --server wss://10.0.0.1:7443 --listen 0.0.0.0:8080 --workers 2 "
        "--pki-dir /var/lib/llmgw-gateway/pki --name gw1"
    )
    assert (service["User"], service["Group"], service["Restart"]) == ("llmgw-gateway", "llmgw-gateway", "always")
    assert service["Environment"] == "SHIV_ROOT=/var/lib/llmgw-gateway/.shiv"
    assert service["WantedBy"] == "multi-user.target"


def test_with_several_control_planes_the_unit_passes_each_as_a_server_this_one_first() -> None:
    """`gateway add --control-plane`: several control planes share a store; the gateway tries each."""
    servers = ("wss://10.0.0.1:7443", "wss://10.0.0.2:7443")
    unit = layout.systemd_unit(**{**UNIT_ARGS, "server": servers})
    service = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert service["ExecStart"].startswith(
        "/usr/local/bin/llmgw gateway --server wss://10.0.0.1:7443 --server wss://10.0.0.2:7443 --listen "
    )
    assert "fed by the control plane at wss://10.0.0.1:7443 and wss://10.0.0.2:7443" in service["Description"]


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    program("systemd-analyze", "systemd")
    # ExecStart must name an executable that exists for verify to pass: this Python stands in for llmgw.
    unit = tmp_path / layout.UNIT_NAME
    unit.write_text(layout.systemd_unit(**UNIT_ARGS, bin_path=sys.executable))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == ""
    broken = tmp_path / "broken.service"
    broken.write_text(layout.systemd_unit(**UNIT_ARGS, bin_path=sys.executable).replace("=strict", "=sometimes"))
    out = subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True, text=True, timeout=60)
    assert "sometimes" in out.stderr  # verify does read what is written


def test_the_unit_sets_each_hardening_and_says_why_for_each_it_leaves_out() -> None:
    lines = layout.systemd_unit(**UNIT_ARGS).splitlines()
    service = lines[lines.index("[Service]") : lines.index("[Install]")]
    directives = dict(line.split("=", 1) for line in service if "=" in line and not line.startswith("#"))
    for key, value in layout.HARDENING:
        assert directives[key] == value
    for key, why in layout.NOT_HARDENED:
        assert key not in directives
        assert f"#   {key}: {why}" in service
    docs = (build_root() / "docs" / "gateway.md").read_text()
    for key, _ in (*layout.HARDENING, *layout.NOT_HARDENED):
        assert f"`{key}" in docs, f"docs/gateway.md does not name {key}"


def test_only_words_systemd_takes_literally_reach_the_units_command() -> None:
    for bad in ({"name": "gw%n"}, {"server": "wss://$HOST:7443"}, {"listen": "0.0.0.0:80 --evil"}):
        with pytest.raises(ValueError, match="cannot go into a unit's ExecStart"):
            layout.gateway_argv(**{**UNIT_ARGS, **bad})


def test_the_gateways_place_and_defaults_are_llmgw_gateways_own() -> None:
    assert layout.PKI_DIR == gateway_command.DEFAULT_PKI_DIR == str(gatewayd_identity.DEFAULT_PKI_DIR)
    assert layout.DEFAULT_LISTEN == gateway_command.DEFAULT_LISTEN


@pytest.mark.parametrize("value", ["0.0.0.0:8080", "[::]:443", "10.0.0.5:1", "gw.example:8080"])
def test_a_listen_address_as_llmgw_gateway_takes_it(value: str) -> None:
    assert layout.check_listen(value) == value


@pytest.mark.parametrize("value", ["8080", ":8080", "0.0.0.0:0", "0.0.0.0:65536", "a b:80", "$(x):80", "h:8o"])
def test_a_listen_address_it_would_refuse_is_refused_first(value: str) -> None:
    with pytest.raises(UsageError, match="must be ADDR:PORT"):
        layout.check_listen(value)


def test_workers_are_a_number_or_auto() -> None:
    assert [layout.check_workers(v) for v in ("1", "16", "auto")] == ["1", "16", "auto"]
    for bad in ("0", "-1", "two", "", "1.5"):
        with pytest.raises(UsageError, match="whole number of workers"):
            layout.check_workers(bad)


# -- the name ------------------------------------------------------------------------------


def test_the_name_is_the_flag_or_the_hostname_and_never_a_nodes() -> None:
    assert install.gateway_name("", "gw-a", "root@10.0.0.31") == ("gw-a", "its hostname")
    assert install.gateway_name("edge1", "gw-a", "root@10.0.0.31") == ("edge1", "--name")
    with pytest.raises(UsageError, match="its hostname 'host_with space' cannot be a gateway's name.*--name NAME"):
        install.gateway_name("", "host_with space", "root@10.0.0.31")
    with pytest.raises(UsageError, match="is the control plane's own gateway workers'"):
        install.gateway_name("control-plane", "gw-a", "root@10.0.0.31")  # the control plane issues that one itself
    install.refuse_a_node_name("gw-a", [{"id": "node-a"}])
    with pytest.raises(UsageError) as err:
        install.refuse_a_node_name("node-a", [{"id": "node-a"}])
    assert "`llmgw node remove node-a` would revoke both" in str(err.value)
    assert str(err.value).endswith("--name node-a-gw")


def test_another_machine_under_the_same_name_is_said() -> None:
    linked = [
        {"name": "gw-a", "instance": "gw-a-0-1", "address": "10.0.0.40", "cert_serial": "abc"},
        {"name": "gw-b", "instance": "gw-b-0-1", "address": "10.0.0.41", "cert_serial": "def"},
    ]
    assert install.sharing(linked, "gw-c", None) == ""
    assert install.sharing(linked, "gw-a", 0xABC) == ""  # this machine itself, running already
    said = install.sharing(linked, "gw-a", None)
    assert said.startswith("a gateway 'gw-a' is connected already from 10.0.0.40 with another certificate")
    assert "`llmgw node remove gw-a` revokes both" in said and "--name NAME" in said
    assert install.sharing(linked, "gw-a", 0x123) == said


# -- join ----------------------------------------------------------------------------------


def _gw(instance: str, serial: str = "5e", name: str = "gw1") -> dict:
    return {"name": name, "instance": instance, "address": "10.0.0.31", "cert_serial": serial}


def test_joined_means_every_worker_of_the_restarted_gateway_linked_with_the_new_certificate() -> None:
    def progress(gateways: list[dict], workers: int = 2) -> tuple[bool, str]:
        return install.link_progress(
            gateways, name="gw1", serial="5e", before=frozenset({"gw1-0-old"}), workers=workers
        )

    assert progress([]) == (False, "the control plane has no link from the gateway yet")
    assert progress([_gw("gw1-0-old")]) == (
        False,
        "the control plane still lists the gateway's workers from before the restart, none of the new",
    )
    assert progress([_gw("gw1-0-new"), _gw("gw1-1-new", serial="99")]) == (False, "1 of 2 worker(s) linked")
    assert progress([_gw("gw1-0-new", name="gw2"), _gw("gw1-1-new", name="gw2")]) == (
        False,
        "the control plane has no link from the gateway yet",
    )
    done, said = progress([_gw("gw1-0-new"), _gw("gw1-1-new"), _gw("gw1-0-old")])
    assert done and said == "linked: 2 worker(s) of gateway 'gw1' connected from 10.0.0.31"


class _Machine:
    """Answers what the join runs there: NRestarts (as given, in turn) and the journal's tail."""

    def __init__(self, restarts: list[int]) -> None:
        self.target = ssh.Target(user="root", host="10.0.0.31")
        self.user = "root"
        self.restarts = restarts
        self.ran: list[list[str]] = []

    async def run(self, argv, *, sudo=False, timeout_s):
        self.ran.append(list(argv))
        if argv[:2] == ["systemctl", "show"]:
            count = self.restarts.pop(0) if len(self.restarts) > 1 else self.restarts[0]
            return ssh.Result(exit_status=0, stdout=f"{count}\n", stderr="")
        if argv[0] == "journalctl":
            return ssh.Result(exit_status=0, stdout="gateway_worker_failed reason=address in use\n", stderr="")
        return ssh.Result(exit_status=1, stdout="", stderr="unexpected")


def _opts(tmp_path: Path, *, timeout_s: float = 60.0, workers: str = "2") -> install.Options:
    return install.Options(
        target="root@10.0.0.31",
        server_config=None,  # type: ignore[arg-type]  # not read by the join
        state_dir=tmp_path,
        known_hosts=tmp_path / "known_hosts",
        join_timeout_s=timeout_s,
        workers=workers,
    )


def _wait(opts: install.Options, machine: _Machine, answers: list[list[dict]], said: list[str]) -> str:
    facts = install.Facts(name="gw1", cert_serial="5e")

    async def poll() -> list[dict]:
        return answers.pop(0) if len(answers) > 1 else answers[0]

    async def wait() -> str:
        return await install.wait_for_link(
            opts,
            machine,
            facts,
            None,
            frozenset({"gw1-0-old"}),
            progress=said.append,
            poll=poll,  # type: ignore[arg-type]
        )

    return trio.run(wait, clock=MockClock(autojump_threshold=0))


def test_the_join_reports_what_it_sees_until_every_worker_linked(tmp_path: Path) -> None:
    said: list[str] = []
    answers = [[_gw("gw1-0-old")], [], [], [_gw("gw1-0-new")], [_gw("gw1-0-new"), _gw("gw1-1-new")]]
    linked = _wait(_opts(tmp_path), _Machine([0]), answers, said)
    assert linked == "linked: 2 worker(s) of gateway 'gw1' connected from 10.0.0.31"
    assert said == [
        "the control plane still lists the gateway's workers from before the restart, none of the new",
        "the control plane has no link from the gateway yet",
        "1 of 2 worker(s) linked",
    ]
    # auto: as many workers as CPUs there, which the control plane cannot tell; one linked says it runs.
    assert _wait(_opts(tmp_path, workers="auto"), _Machine([0]), [[_gw("gw1-0-new")]], []).startswith("linked: 1")


def test_a_gateway_systemd_keeps_restarting_ends_the_wait_with_its_log(tmp_path: Path) -> None:
    machine = _Machine([0, 1, 2, 3])
    with pytest.raises(PeerError) as err:
        _wait(_opts(tmp_path, timeout_s=600.0), machine, [[]], [])
    text = str(err.value)
    assert text.startswith("the gateway on root@10.0.0.31 keeps exiting: systemd started it again 3 times.")
    assert "journalctl -u llmgw-gateway.service" in text and "reason=address in use" in text
    assert machine.ran[-1] == ["journalctl", "-u", "llmgw-gateway.service", "-n", "15", "--no-pager"]


def test_the_join_timeout_says_what_was_seen_and_shows_the_log(tmp_path: Path) -> None:
    machine = _Machine([0])
    with pytest.raises(PeerError) as err:
        _wait(attrs.evolve(_opts(tmp_path, timeout_s=30.0)), machine, [[_gw("gw1-0-old")]], [])
    text = str(err.value)
    assert text.startswith(
        "gateway 'gw1' did not link to the control plane within 30 s: the control plane still lists the gateway's "
        "workers from before the restart"
    )
    assert text.endswith("its last lines:\ngateway_worker_failed reason=address in use")
