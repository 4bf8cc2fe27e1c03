"""The pure parts of `llmgw node add`: the files it writes, the release it picks, the address
it checks and what "joined" means. The whole flow against a real node is test_node_add_e2e.py."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import attrs
import pytest
import tomllib
import trio
from trio.testing import MockClock

from llmgw import config as cfg
from llmgw.errors import ConfigError, MachineError, PeerError, UsageError
from llmgw.nodeadd import identify, release, ssh
from llmgw.nodeadd.node import doctor, install, layout
from llmgw.nodeadd.node.install import Facts, Options
from llmgw.nodeadd.questions import Unattended
from llmgw.pki.ca import CertInfo
from llmgw.pki.files import init_ca, issue_server_cert, load_ca
from testlib.needs import program
from testlib.proc import build_root


def test_agent_toml_is_what_the_agent_loads(tmp_path: Path) -> None:
    text = layout.agent_toml(
        server="wss://10.0.0.1:7443",
        node_id="node-a",
        fabrics=(cfg.FabricDecl(name="ib-a", adapters=("mlx5_0", "mlx5_1")),),
        llamacpp_bin="/opt/llama/llama-server",
    )
    (tmp_path / "agent.toml").write_text(text)
    loaded = cfg.load_agent_config(tmp_path / "agent.toml")
    assert loaded.server == "wss://10.0.0.1:7443"
    assert loaded.node_id == "node-a"
    assert loaded.state_dir == layout.STATE_DIR
    assert loaded.fabrics == (cfg.FabricDecl(name="ib-a", adapters=("mlx5_0", "mlx5_1")),)
    assert loaded.llamacpp_bin == "/opt/llama/llama-server"
    assert "vllm_bin" not in text  # defaults are left out


def test_agent_toml_names_every_control_plane_given_this_one_first(tmp_path: Path) -> None:
    """`node add --control-plane`: several control planes share a store; the agent tries each."""
    text = layout.agent_toml(server=("wss://10.0.0.1:7443", "wss://10.0.0.2:7443"), node_id="node-a")
    assert 'server = [\n    "wss://10.0.0.1:7443",\n    "wss://10.0.0.2:7443",\n]' in text
    (tmp_path / "agent.toml").write_text(text)
    loaded = cfg.load_agent_config(tmp_path / "agent.toml")
    assert cfg.control_planes(loaded) == ("wss://10.0.0.1:7443", "wss://10.0.0.2:7443")


def test_the_other_control_planes_follow_this_ones_in_agent_toml_once_each() -> None:
    from llmgw.nodeadd.node.install import _agent_toml

    opts = Options(
        target="root@node-a",
        server_config=cfg.ServerConfig(),
        state_dir=Path("/nonexistent"),
        known_hosts=Path("/nonexistent"),
        control_planes=("wss://10.0.0.2:7443", "wss://10.0.0.1:7443"),  # this one named again: once
    )
    facts = Facts(node_id="node-a", address="10.0.0.1", port=7443)
    loaded = cfg.agent_config_from_dict(tomllib.loads(_agent_toml(opts, facts)), "agent.toml")
    assert loaded.server == ("wss://10.0.0.1:7443", "wss://10.0.0.2:7443")
    alone = attrs.evolve(opts, control_planes=())
    assert cfg.agent_config_from_dict(tomllib.loads(_agent_toml(alone, facts)), "agent.toml").server == (
        "wss://10.0.0.1:7443"
    )  # one control plane: the single form, as before


def test_agent_toml_refuses_a_bad_server() -> None:
    with pytest.raises(ConfigError, match="server"):
        layout.agent_toml(server="10.0.0.1:7443", node_id="node-a")


def test_the_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    program("systemd-analyze", "systemd")
    # ExecStart must name an executable that exists for verify to pass: this Python stands in for llmgw.
    unit = tmp_path / layout.UNIT_NAME
    unit.write_text(layout.systemd_unit(bin_path=sys.executable))
    out = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stderr.strip() == ""
    broken = tmp_path / "broken.service"
    broken.write_text(layout.systemd_unit(bin_path=sys.executable).replace("Restart=always", "Restart=sometimes"))
    out = subprocess.run(["systemd-analyze", "verify", str(broken)], capture_output=True, text=True, timeout=60)
    assert "sometimes" in out.stderr  # verify does read what is written


def test_the_unit_sets_each_hardening_and_says_why_for_each_it_leaves_out() -> None:
    lines = layout.systemd_unit().splitlines()
    service = lines[lines.index("[Service]") : lines.index("[Install]")]
    directives = dict(line.split("=", 1) for line in service if "=" in line and not line.startswith("#"))
    for key, value in layout.HARDENING:
        assert directives[key] == value
    for key, why in layout.NOT_HARDENED:
        assert key not in directives
        assert f"#   {key}: {why}" in service
    docs = (build_root() / "docs" / "node-onboarding.md").read_text()
    for key, _ in (*layout.HARDENING, *layout.NOT_HARDENED):
        assert f"`{key}" in docs, f"docs/node-onboarding.md does not name {key}"


def test_probe_output_is_read_from_stdout_only() -> None:
    facts = layout.parse_probe(
        "hostname=node-a\narch=aarch64\nsystemd=no\nos_id=debian\ntool=/usr/sbin/update-ca-certificates\n"
    )
    assert facts == layout.Probe(
        hostname="node-a",
        arch="aarch64",
        systemd=False,
        os_id="debian",
        tools=frozenset({"/usr/sbin/update-ca-certificates"}),
    )
    # The first value wins, and a line that is not key=value (a warning someone printed) is ignored.
    assert layout.parse_probe("Warning: Permanently added\nhostname=a\nhostname=b\n") == layout.Probe(hostname="a")


# -- the release ---------------------------------------------------------------------------


def _pyz(path: Path) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("__main__.py", "print('hi')\n")
    return path


def _sums(directory: Path, *names: str) -> None:
    lines = [f"{hashlib.sha256((directory / n).read_bytes()).hexdigest()}  {n}" for n in names]
    (directory / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def test_a_release_directory_gives_the_file_for_the_architecture(tmp_path: Path) -> None:
    amd = _pyz(tmp_path / "llmgw-0.3.0-linux-amd64.pyz")
    arm = _pyz(tmp_path / "llmgw-0.3.0-linux-arm64.pyz")
    arm.write_bytes(arm.read_bytes() + b"\n")  # different bytes
    _sums(tmp_path, amd.name, arm.name)
    got = release.find_artifact(str(tmp_path), release.release_arch("aarch64"))
    assert got.path == arm
    assert got.version == "0.3.0"
    assert got.sha256 == hashlib.sha256(arm.read_bytes()).hexdigest()


def test_a_damaged_file_is_refused_before_it_is_shipped(tmp_path: Path) -> None:
    amd = _pyz(tmp_path / "llmgw-0.3.0-linux-amd64.pyz")
    _sums(tmp_path, amd.name)
    amd.write_bytes(amd.read_bytes() + b"x")
    with pytest.raises(MachineError, match="damaged or not the released one"):
        release.find_artifact(str(tmp_path), "amd64")


def test_a_directory_without_the_architecture_says_which_is_missing(tmp_path: Path) -> None:
    amd = _pyz(tmp_path / "llmgw-0.3.0-linux-amd64.pyz")
    _sums(tmp_path, amd.name)
    with pytest.raises(UsageError, match="no llmgw-VERSION-linux-arm64.pyz"):
        release.find_artifact(str(tmp_path), "arm64")
    (tmp_path / "SHA256SUMS").unlink()
    with pytest.raises(UsageError, match="has no SHA256SUMS"):
        release.find_artifact(str(tmp_path), "amd64")


def test_a_single_file_must_be_for_the_node(tmp_path: Path) -> None:
    amd = _pyz(tmp_path / "llmgw-0.3.0-linux-amd64.pyz")
    assert release.find_artifact(str(amd), "amd64").sha256 == hashlib.sha256(amd.read_bytes()).hexdigest()
    with pytest.raises(UsageError, match="is the amd64 release; the node is arm64"):
        release.find_artifact(str(amd), "arm64")


def test_a_development_build_is_not_shipped() -> None:
    # These tests run from a checkout (or a PEX), not a release zipapp.
    with pytest.raises(UsageError, match="not a release build"):
        release.find_artifact("", "amd64")


def test_an_unknown_machine_is_said() -> None:
    with pytest.raises(UsageError, match="'riscv64'"):
        release.release_arch("riscv64")


# -- the address ---------------------------------------------------------------------------


def _server_cert(tmp_path: Path, sans: list[str]) -> CertInfo:
    init_ca(tmp_path, validity_days=30)
    return issue_server_cert(load_ca(tmp_path), tmp_path, sans, validity_days=30)


def _opts(tmp_path: Path, *, agent_listen: str = "0.0.0.0:7443", server_address: str = "") -> Options:
    server = cfg.server_config_from_dict({"server": {"agent_listen": agent_listen}})
    return Options(
        target="root@127.0.0.1",
        server_config=server,
        state_dir=tmp_path,
        known_hosts=tmp_path / "known_hosts",
        server_address=server_address,
    )


def test_the_source_address_on_the_route_must_be_in_the_server_certificate(tmp_path: Path) -> None:
    cert = _server_cert(tmp_path, ["127.0.0.1"])
    assert identify.agent_address(_opts(tmp_path), "127.0.0.1", cert) == ("127.0.0.1", 7443)
    other = _server_cert(tmp_path / "other", ["10.9.9.9"])
    with pytest.raises(ConfigError) as err:
        identify.agent_address(_opts(tmp_path), "127.0.0.1", other)
    assert "127.0.0.1" in str(err.value) and "--san 10.9.9.9 --san 127.0.0.1" in str(err.value)


def test_a_named_server_address_is_checked_too(tmp_path: Path) -> None:
    cert = _server_cert(tmp_path, ["cp.example.net", "127.0.0.1"])
    opts = _opts(tmp_path, server_address="CP.example.net")
    assert identify.agent_address(opts, "127.0.0.1", cert) == ("CP.example.net", 7443)
    with pytest.raises(ConfigError, match="--server-address"):
        identify.agent_address(_opts(tmp_path, server_address="other.example.net"), "127.0.0.1", cert)


def test_an_agent_port_bound_elsewhere_or_to_port_0_is_refused(tmp_path: Path) -> None:
    cert = _server_cert(tmp_path, ["127.0.0.1"])
    with pytest.raises(ConfigError, match="port 0"):
        identify.agent_address(_opts(tmp_path, agent_listen="0.0.0.0:0"), "127.0.0.1", cert)
    with pytest.raises(ConfigError, match="cannot reach it at 127.0.0.1"):
        identify.agent_address(_opts(tmp_path, agent_listen="10.1.1.1:7443"), "127.0.0.1", cert)


# -- joined --------------------------------------------------------------------------------


def _node(**over) -> dict:
    node = {
        "id": "node-a",
        "state": "joined",
        "connected": True,
        "cordoned": False,
        "agent_started_at": 200.0,
        "engines": [{"name": "llamacpp", "version": "b4000", "ok": True, "detail": ""}],
    }
    node.update(over)
    return node


def test_joined_means_the_restarted_agent_heartbeated_and_checked_llama_cpp() -> None:
    assert install.join_progress(_node(), started_before=100.0)[0] == install.JOINED
    assert install.join_progress(_node(), started_before=None)[0] == install.JOINED
    # A node known from before (joined, even cordoned) is not joined until its new agent has said so.
    state, why = install.join_progress(_node(cordoned=True), started_before=200.0)
    assert state == install.WAITING and "from before the restart" in why
    state, why = install.join_progress(None, started_before=None)
    assert state == install.WAITING and "not heard" in why
    state, why = install.join_progress(_node(state="joining"), started_before=100.0)
    assert state == install.WAITING and "heartbeat" in why
    state, why = install.join_progress(_node(engines=[]), started_before=100.0)
    assert state == install.WAITING and "llama.cpp is not installed yet" in why
    state, why = install.join_progress(_node(connected=False, state="lost"), started_before=100.0)
    assert state == install.WAITING and "not connected" in why


def test_a_llama_cpp_the_agent_cannot_use_ends_the_wait() -> None:
    bad = [{"name": "llamacpp", "version": "", "ok": False, "detail": "no llama-server at /x"}]
    state, why = install.join_progress(_node(engines=bad), started_before=100.0)
    assert state == install.BROKEN and "no llama-server at /x" in why


def test_a_node_without_what_a_build_needs_joins_and_the_step_warns(tmp_path: Path) -> None:
    """The join is not held back by llama.cpp being unavailable on the node (no compiler for the
    build it would need): the node has joined, the step warns with the reason and the run goes on."""
    missing = "this node cannot build llama.cpp: missing on the agent's PATH (/usr/bin): cmake; install them: ..."
    unavailable = [{"name": "llamacpp", "version": "b11434", "ok": False, "state": "unavailable", "detail": missing}]
    state, why = install.join_progress(_node(engines=unavailable), started_before=100.0)
    assert state == install.UNAVAILABLE
    assert why.startswith(f"joined without llama.cpp: unavailable: {missing}")

    admin = type("Admin", (), {"nodes": lambda self: [_node(engines=unavailable)]})()

    async def wait() -> install.Joined:
        return await install.wait_for_join(
            _opts(tmp_path), _Session(), Facts(node_id="node-a"), admin, 100.0, poll=_polled(admin)
        )

    joined = trio.run(wait, clock=MockClock(autojump_threshold=0))
    assert joined.warn and joined.detail == why


class _Admin:
    """The admin API as node add polls it: a node that connected but never heartbeats."""

    def __init__(self) -> None:
        self.polls = 0

    def nodes(self) -> list[dict]:
        self.polls += 1
        return [_node(state="joining", agent_started_at=300.0)]


class _Session:
    """Answers the one command the timeout runs: the tail of the agent's log."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []

    async def run(self, argv, *, sudo=False, timeout_s):
        self.ran.append(list(argv))
        return ssh.Result(exit_status=0, stdout="agent_connect_failed reason=refused\n", stderr="")


def test_the_join_timeout_says_what_is_missing_and_shows_the_log(tmp_path: Path) -> None:
    opts = attrs.evolve(_opts(tmp_path), join_timeout_s=30.0)
    facts = Facts(node_id="node-a", systemd=False)
    admin, session = _Admin(), _Session()

    async def wait() -> install.Joined:
        return await install.wait_for_join(opts, session, facts, admin, started_before=200.0)

    with pytest.raises(PeerError) as err:
        trio.run(wait, clock=MockClock(autojump_threshold=0))
    text = str(err.value)
    assert text.startswith("node-a did not finish joining: nothing new for 30 s: the agent is connected but has not")
    assert "/var/log/llmgw-agent.log" in text and "agent_connect_failed reason=refused" in text
    assert session.ran == [["tail", "-n", "15", "--", "/var/log/llmgw-agent.log"]]
    assert admin.polls >= 1


def _installing(percent: int | None, phase: str = "build") -> dict:
    llama = {"name": "llamacpp", "version": "b4000", "ok": False, "detail": "installing b4000"}
    return _node(engines=[{**llama, "state": "installing", "phase": phase, "percent": percent}])


def test_an_install_under_way_is_waited_for_and_said() -> None:
    state, why = install.join_progress(_installing(40), started_before=100.0)
    assert (state, why) == (install.WAITING, "joined; installing llama.cpp 40% (build)")
    state, why = install.join_progress(_installing(None, "check"), started_before=100.0)
    assert (state, why) == (install.WAITING, "joined; installing llama.cpp (check)")


def _polled(admin):
    """The poll without a thread, so the fake clock moves only by the join's own sleeps."""

    async def poll() -> list[dict]:
        return admin.nodes()

    return poll


class _Building:
    """The admin API while the node builds llama.cpp: 10% more every `step` polls, then joined."""

    def __init__(self, step: int) -> None:
        self.polls, self.step = 0, step

    def nodes(self) -> list[dict]:
        self.polls += 1
        percent = (self.polls // self.step) * 10
        return [_node() if percent > 100 else _installing(percent)]


def test_the_join_waits_past_its_timeout_while_progress_keeps_coming_and_reports_each_step(tmp_path: Path) -> None:
    # A 60 s timeout and a build that moves 10% every 40 s: 440 s in all, never 60 s without news.
    opts = attrs.evolve(_opts(tmp_path), join_timeout_s=60.0)
    admin, said = _Building(step=40), []

    async def wait() -> tuple[install.Joined, float]:
        done = await install.wait_for_join(
            opts, _Session(), Facts(node_id="node-a"), admin, 100.0, progress=said.append, poll=_polled(admin)
        )
        return done, trio.current_time()

    done, took = trio.run(wait, clock=MockClock(autojump_threshold=0))
    assert done == install.Joined(detail="joined; llama.cpp installed and checked (b4000)")
    assert took > 400
    assert said == [f"joined; installing llama.cpp {p}% (build)" for p in range(0, 101, 10)]  # each once


def test_the_join_gives_up_when_the_progress_stops(tmp_path: Path) -> None:
    opts = attrs.evolve(_opts(tmp_path), join_timeout_s=60.0)

    class Stuck(_Building):
        def nodes(self) -> list[dict]:
            self.polls += 1
            return [_installing(min(self.polls // 10, 3) * 10)]  # 0, 10, 20, 30% and no further

    admin, said = Stuck(step=10), []

    async def wait() -> install.Joined:
        return await install.wait_for_join(
            opts, _Session(), Facts(node_id="node-a"), admin, 100.0, progress=said.append, poll=_polled(admin)
        )

    with pytest.raises(PeerError) as err:
        trio.run(wait, clock=MockClock(autojump_threshold=0))
    assert "nothing new for 60 s: joined; installing llama.cpp 30% (build)" in str(err.value)
    assert said[-1] == "joined; installing llama.cpp 30% (build)" and len(said) == 4


# -- fabrics -------------------------------------------------------------------------------

GROUPS = {
    "fabric_groups": [
        {"identity": "ib-sm:0x0002c90300a1b2c3", "kind": "infiniband", "adapters": ["mlx5_0", "mlx5_1"]},
        {"identity": "roce:10.20.0.0/24", "kind": "roce", "adapters": ["mlx5_2"]},
    ]
}
CLUSTER = [{"id": "node-b", "fabrics": [{"name": "ib-a"}]}, {"id": "node-c", "fabrics": []}]


class Recorder(Unattended):
    """Unattended answers, remembering what the step offered."""

    asked: list = []

    async def name_fabrics(self, groups, existing, given):
        Recorder.asked.append((tuple(g.adapters for g in groups), tuple(existing)))
        return await super().name_fabrics(groups, existing, given)


def _fabrics(tmp_path: Path, decls: tuple[cfg.FabricDecl, ...], inventory: dict) -> tuple[str, str, tuple]:
    opts = attrs.evolve(_opts(tmp_path), fabrics=decls)
    facts = Facts()
    status, text = trio.run(doctor.fabrics, opts, facts, inventory, CLUSTER, Recorder())
    return status, text, facts.fabrics


def test_fabric_groups_are_offered_with_the_clusters_names_and_answered_by_flags(tmp_path: Path) -> None:
    Recorder.asked.clear()
    decl = cfg.FabricDecl(name="ib-a", adapters=("mlx5_0", "mlx5_1"))
    status, text, decls = _fabrics(tmp_path, (decl,), GROUPS)
    assert Recorder.asked == [((("mlx5_0", "mlx5_1"), ("mlx5_2",)), ("ib-a",))]
    assert decls == (decl,)
    # The RoCE group was named by nobody: said, with the flag that would name it.
    assert status == "warn" and "--fabric NAME:mlx5_2" in text and "ib-a: mlx5_0,mlx5_1" in text


def test_no_adapters_and_no_flags_asks_nothing(tmp_path: Path) -> None:
    Recorder.asked.clear()
    status, text, decls = _fabrics(tmp_path, (), {"fabric_groups": []})
    assert (status, decls, Recorder.asked) == ("ok", (), [])
    assert "its own island" in text


def test_a_fabric_flag_for_adapters_no_group_reports_is_kept(tmp_path: Path) -> None:
    # Doctor checked it (an adapter not active yet, say); the answer covers discovered groups only.
    quiet = cfg.FabricDecl(name="ib-b", adapters=("mlx5_4",))
    status, text, decls = _fabrics(tmp_path, (quiet,), {"fabric_groups": []})
    assert decls == (quiet,) and status == "ok" and "ib-b: mlx5_4" in text


def test_adding_again_keeps_the_settings_node_add_does_not_own(tmp_path: Path) -> None:
    before = cfg.agent_config_from_dict(
        {
            "server": "wss://10.0.0.9:7443",
            "node_id": "node-a",
            "nvidia_smi": "/opt/nvidia/bin/nvidia-smi",
            "weights_dir": "/data/weights",
            "llamacpp_bin": "/opt/llama/llama-server",
        }
    )
    text = layout.agent_toml(server="wss://10.0.0.1:7443", node_id="node-a", keep=before)
    (tmp_path / "agent.toml").write_text(text)
    after = cfg.load_agent_config(tmp_path / "agent.toml")
    assert after.server == "wss://10.0.0.1:7443"  # node add's own keys are rewritten
    assert (after.nvidia_smi, after.weights_dir) == ("/opt/nvidia/bin/nvidia-smi", "/data/weights")
    assert "ib_root" not in text and "sminfo" not in text  # defaults stay unwritten
