"""server.toml / agent.toml loading: every problem reported with its path; the docs' examples load."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import attrs
import pytest

from llmgw import config, pins
from llmgw.errors import ConfigError
from llmgw.http.limits import Limits
from testlib.proc import build_root


def problems_of(data: dict, kind: str = "server") -> list[str]:
    load = config.server_config_from_dict if kind == "server" else config.agent_config_from_dict
    with pytest.raises(ConfigError) as info:
        load(data)
    return info.value.problems


def test_empty_server_file_is_valid_with_defaults() -> None:
    cfg = config.server_config_from_dict({})
    assert cfg.server.state_dir == "/var/lib/llmgw"
    assert cfg.models == ()


def test_the_http_section_is_the_http_servers_limits_with_the_agent_ports_budget() -> None:
    values = {
        "head_timeout_s": 2.5,
        "body_timeout_s": 7.0,
        "body_min_bytes_per_s": 10,
        "keepalive_timeout_s": 3.0,
        "send_timeout_s": 4.0,
        "max_head_bytes": 4096,
        "max_body_bytes": 4096,
        "body_budget_bytes": 8192,
        "max_connections": 9,
    }
    assert set(values) == {f.name for f in attrs.fields(Limits)}  # every limit of the server is a key
    cfg = config.server_config_from_dict({"http": {**values, "max_agent_connections": 3}})
    assert isinstance(cfg.http, Limits)  # what the listeners take as it is
    assert attrs.asdict(cfg.http) == {**values, "max_agent_connections": 3}
    assert "unknown key 'max_conections'" in " ".join(problems_of({"http": {"max_conections": 1}}))


def test_wrong_type_names_its_path() -> None:
    data = {"models": [{"name": "a", "engine": "sim"}, {"name": "b", "engine": "sim", "replicas": "2"}]}
    assert problems_of(data) == ["expected int, got str '2' @ $.models[1].replicas"]


def test_unknown_key_is_named_with_the_allowed_ones() -> None:
    [problem] = problems_of({"server": {"stat_dir": "/x"}})
    assert problem.startswith("unknown key 'stat_dir' (allowed here: admin_url, advertise, agent_listen, agent_url,")
    assert problem.endswith("@ $.server")


def test_every_problem_is_reported_in_one_run() -> None:
    data = {
        "server": {"advertise": "10.0.0.1", "heartbeat_ttl_s": "30"},
        "ca": 3,
        "models": [{"engine": "sim"}, "oops", {"name": "c", "engine": "sim", "args": [1]}],
    }
    assert sorted(problems_of(data)) == sorted(
        [
            "expected a list, got str '10.0.0.1' @ $.server.advertise",
            "expected a number, got str '30' @ $.server.heartbeat_ttl_s",
            "expected a table, got int 3 @ $.ca",
            "required key is missing @ $.models[0].name",
            "expected a table, got str 'oops' @ $.models[1]",
            "expected a string, got int 1 @ $.models[2].args[0]",
        ]
    )


@pytest.mark.parametrize(
    ("rate", "says"),
    [
        (-1, "must be a number of heartbeats a second, 0 or more"),
        (float("nan"), "must be a number of heartbeats a second, 0 or more"),
        (0.1, "heartbeat_max_rate (0.1) takes fewer than one agent at heartbeat_interval_s (5.0)"),
    ],
)
def test_a_heartbeat_rate_that_holds_no_agent_is_refused(rate: float, says: str) -> None:
    got = problems_of({"server": {"heartbeat_max_rate": rate}})
    assert any(says in p and p.endswith("@ $.server.heartbeat_max_rate") for p in got), got
    assert config.server_config_from_dict({"server": {"heartbeat_max_rate": 0}}).server.heartbeat_max_rate == 0
    assert config.server_config_from_dict({}).server.heartbeat_max_rate == 50.0


def test_rules_across_fields_are_checked_after_types() -> None:
    data = {
        "server": {"heartbeat_interval_s": 10, "heartbeat_ttl_s": 5, "http_listen": "8080"},
        "models": [
            {"name": "m", "engine": "sim"},
            {"name": "m", "engine": "llamacpp", "nodes_per_replica": 2, "source": {"path": "models/x"}},
            {"name": "../evil", "engine": "tensorrt", "source": {"url": "https://x/y", "sha256": "abc"}},
        ],
    }
    got = problems_of(data)
    assert "heartbeat_ttl_s (5.0) must be longer than heartbeat_interval_s (10.0) @ $.server.heartbeat_ttl_s" in got
    assert "expected HOST:PORT, got '8080' @ $.server.http_listen" in got
    assert "model name 'm' is already used by $.models[0] @ $.models[1].name" in got
    assert not any("nodes_per_replica" in p for p in got)  # llama.cpp over several nodes: its RPC (issue 49)
    assert "path must be absolute on the nodes, got 'models/x' @ $.models[1].source.path" in got
    assert any(p.startswith("model name '../evil' may use only") for p in got)
    assert "unknown engine 'tensorrt' (one of: llamacpp, vllm, sglang, sim) @ $.models[2].engine" in got
    assert "a url source needs sha256 = 64 lowercase hex digits @ $.models[2].source.sha256" in got


def test_download_sizes_and_maxima_are_checked() -> None:
    url = {"url": "https://x/m.gguf", "sha256": "a" * 64}
    data = {
        "downloads": {"max_archive_gib": 0},
        "engines": {
            "llamacpp": {
                "version": "b1",
                "archives": [
                    {"arch": "x86_64", "url": "https://x/a.tgz", "sha256": "b" * 64, "binary": "b", "size": -1}
                ],
            }
        },
        "models": [
            {"name": "a", "engine": "llamacpp", "source": {**url, "size": -5}},
            {"name": "b", "engine": "llamacpp", "source": {"path": "/m/b.gguf", "size": 5}},
        ],
    }
    got = problems_of(data)
    assert "must be at least 1 @ $.downloads.max_archive_gib" in got
    assert "must not be negative (0: not given), got -1 @ $.engines.llamacpp.archives[0].size" in got
    assert "must not be negative (0: not given), got -5 @ $.models[0].source.size" in got
    assert "size is the size of the file at url; give it with url, not path @ $.models[1].source.size" in got
    fine = config.server_config_from_dict(
        {"models": [{"name": "a", "engine": "llamacpp", "source": {**url, "size": 5}}]}
    )
    assert fine.models[0].source.size == 5 and fine.downloads.max_weights_bytes == 64 << 30


def test_integer_accepted_where_a_number_is_expected_but_bool_is_not_an_int() -> None:
    cfg = config.server_config_from_dict({"server": {"heartbeat_ttl_s": 60}})
    assert cfg.server.heartbeat_ttl_s == 60.0
    assert problems_of({"models": [{"name": "a", "engine": "sim", "replicas": True}]}) == [
        "expected int, got bool True @ $.models[0].replicas"
    ]


def test_agent_adapter_under_two_fabrics_is_refused() -> None:
    data = {
        "server": "wss://10.0.0.1:7443",
        "fabrics": [{"name": "ib-a", "adapters": ["mlx5_0", "mlx5_1"]}, {"name": "ib-b", "adapters": ["mlx5_1"]}],
    }
    [problem] = problems_of(data, "agent")
    assert problem.startswith("adapter 'mlx5_1' is under fabrics 'ib-a' and 'ib-b'")
    assert problem.endswith("@ $.fabrics[1].adapters")


def test_agent_needs_a_wss_server() -> None:
    assert problems_of({}, "agent") == ["required key is missing @ $.server"]
    assert problems_of({"server": "http://x:1"}, "agent") == [
        "expected a wss:// URL of the control plane, got 'http://x:1' @ $.server"
    ]


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        config.load_server_config(tmp_path / "missing.toml")
    assert str(info.value).startswith(f"{tmp_path / 'missing.toml'}: file not found")
    bad = tmp_path / "server.toml"
    bad.write_text("[server\nstate_dir = 1\n")
    with pytest.raises(ConfigError) as info:
        config.load_server_config(bad)
    assert "not valid TOML" in str(info.value) and "line 1" in str(info.value)


def test_secret_is_redacted_in_repr_and_dict() -> None:
    cfg = config.server_config_from_dict(
        {"models": [{"name": "a", "engine": "llamacpp", "source": {"path": "/m", "token": "s3cr3t-t0ken"}}]}
    )
    assert cfg.models[0].source.token.reveal() == "s3cr3t-t0ken"
    assert "s3cr3t-t0ken" not in repr(cfg)
    assert "s3cr3t-t0ken" not in str(config.to_dict(cfg))


def doc_examples() -> list[tuple[str, str, str]]:
    """(doc file, kind, text) of every ```toml block in docs/ and every docs/examples file whose
    first line names its kind (`# server.toml` or `# agent.toml`)."""
    found = []
    docs = build_root() / "docs"
    for doc in sorted(docs.glob("*.md")) + sorted(docs.glob("examples/*.toml")):
        text = doc.read_text()
        blocks = [text] if doc.suffix == ".toml" else re.findall(r"```toml\n(.*?)```", text, flags=re.S)
        for block in blocks:
            first = block.splitlines()[0].strip()
            m = re.fullmatch(r"# (server|agent)\.toml", first)
            if m:
                found.append((doc.name, m.group(1), block))
    return found


def test_docs_have_examples_of_both_files() -> None:
    found = {(doc, kind) for doc, kind, _ in doc_examples()}
    assert {("configuration.md", "server"), ("configuration.md", "agent"), ("server.toml", "server")} <= found


@pytest.mark.parametrize(("doc", "kind", "text"), doc_examples())
def test_each_config_example_in_the_docs_loads(doc: str, kind: str, text: str) -> None:
    data = config.parse_toml(text, f"{doc} example")
    load = config.server_config_from_dict if kind == "server" else config.agent_config_from_dict
    load(data, f"{doc} example")


def test_every_key_is_documented() -> None:
    doc = (build_root() / "docs" / "configuration.md").read_text()

    def keys(cls: type) -> set[str]:
        out = set()
        for name, hint in typing.get_type_hints(cls).items():
            out.add(name)
            for t in (hint, *typing.get_args(hint)):
                if isinstance(t, type) and attrs.has(t) and t is not config.Secret:
                    out |= keys(t)
        return out

    every = keys(config.ServerConfig) | keys(config.AgentConfig)
    assert {"replicas", "sha256", "adapters", "node_cert_validity_days"} <= every
    documented = set(re.findall(r"`([a-z0-9_]+)`", doc)) | set(re.findall(r"`\[+([a-z0-9_]+)\]+`", doc))
    assert every - documented == set()


def test_a_model_of_an_engine_turned_off_is_refused() -> None:
    cfg = config.server_config_from_dict({"engines": {"llamacpp": {"enabled": False}}})
    assert not cfg.engines.llamacpp.enabled
    model = {"name": "m", "engine": "llamacpp", "source": {"path": "/m.gguf"}}
    problems = problems_of({"engines": {"llamacpp": {"enabled": False}}, "models": [model]})
    assert problems == [
        "model 'm' uses llamacpp, which [engines.llamacpp] turns off (enabled = false); remove that line or this "
        "model @ $.models[0].engine"
    ]


def test_engine_unpack_caps_default_and_must_be_positive() -> None:
    cfg = config.server_config_from_dict({})
    assert cfg.engines.llamacpp.max_unpacked_bytes == config.DEFAULT_MAX_UNPACKED_BYTES == 8 << 30
    assert cfg.engines.llamacpp.max_members == config.DEFAULT_MAX_MEMBERS == 50_000
    cfg = config.server_config_from_dict({"engines": {"llamacpp": {"max_unpacked_bytes": 1 << 20, "max_members": 9}}})
    assert (cfg.engines.llamacpp.max_unpacked_bytes, cfg.engines.llamacpp.max_members) == (1 << 20, 9)
    got = problems_of({"engines": {"vllm": {"max_unpacked_bytes": 0, "max_members": -1}}})
    assert "must be at least 1, got 0 @ $.engines.vllm.max_unpacked_bytes" in got
    assert "must be at least 1, got -1 @ $.engines.vllm.max_members" in got
    assert any(
        "$.engines.llamacpp.max_members" in p for p in problems_of({"engines": {"llamacpp": {"max_members": "9"}}})
    )


def test_vllm_is_on_by_default_pinned_and_a_table_without_a_version_keeps_the_pin() -> None:
    default = config.server_config_from_dict({}).engines.vllm
    assert default.enabled and default.version == config.DEFAULT_VLLM_VERSION
    assert config.pip_requirement("vllm", default) == f"vllm=={config.DEFAULT_VLLM_VERSION}"
    mirrored = config.server_config_from_dict(
        {"engines": {"vllm": {"index_url": "https://mirror.example/simple", "extra_index_url": ["https://t.example/"]}}}
    ).engines.vllm
    assert mirrored.version == config.DEFAULT_VLLM_VERSION and mirrored.index_url == "https://mirror.example/simple"
    assert mirrored.extra_index_url == ("https://t.example/",)
    assert not config.server_config_from_dict({"engines": {"vllm": {"enabled": False}}}).engines.vllm.enabled
    operators = config.server_config_from_dict({"engines": {"vllm": {"version": ""}}}).engines.vllm
    assert config.pip_requirement("vllm", operators) == ""  # the operator's own install (vllm_bin)
    own = config.server_config_from_dict({"engines": {"vllm": {"version": "0.31.0", "pip": "vllm[audio]==0.31.0"}}})
    assert config.pip_requirement("vllm", own.engines.vllm) == "vllm[audio]==0.31.0"
    sglang = config.server_config_from_dict({"engines": {"sglang": {"version": "0.5.23"}}}).engines.sglang
    assert config.pip_requirement("sglang", sglang) == "sglang==0.5.23"
    assert config.server_config_from_dict({}).engines.sglang is None


def test_an_index_must_be_a_url_and_belong_to_a_pip_install() -> None:
    got = problems_of({"engines": {"vllm": {"index_url": "mirror.example/simple", "extra_index_url": ["ftp://x"]}}})
    assert "expected an http(s) URL of a package index, got 'mirror.example/simple' @ $.engines.vllm.index_url" in got
    assert "expected an http(s) URL of a package index, got 'ftp://x' @ $.engines.vllm.extra_index_url" in got
    got = problems_of({"engines": {"vllm": {"version": "", "index_url": "https://m.example/simple"}}})
    assert any(p.startswith("index_url and extra_index_url are where pip finds vllm") for p in got)
    # SGLang's version alone is enough: pip installs sglang==VERSION.
    assert config.server_config_from_dict({"engines": {"sglang": {"version": "0.5.23"}}}).engines.sglang.version


def test_llamacpp_by_default_is_the_pinned_release_built_from_its_source() -> None:
    from llmgw import pins

    llamacpp = config.server_config_from_dict({}).engines.llamacpp
    assert llamacpp.enabled and llamacpp.version == pins.LLAMACPP_VERSION and not llamacpp.archives
    assert llamacpp.build == config.EngineBuild(
        url=pins.LLAMACPP_SDIST_URL, sha256=pins.LLAMACPP_SDIST_SHA256, size=pins.LLAMACPP_SDIST_SIZE
    )
    assert (llamacpp.build.jobs, llamacpp.build.timeout_s) == (0, 7200.0)
    # A table that changes something else keeps the pinned build.
    tuned = config.server_config_from_dict({"engines": {"llamacpp": {"max_members": 60000}}}).engines.llamacpp
    assert tuned.version == pins.LLAMACPP_VERSION and tuned.build == llamacpp.build


def test_the_three_ways_to_get_llamacpp_are_said_in_server_toml() -> None:
    archive = {"arch": "x86_64", "url": "https://x/a.tgz", "sha256": "b" * 64, "binary": "bin/llama-server"}

    def llamacpp(table: dict) -> config.LlamacppSource:
        return config.server_config_from_dict({"engines": {"llamacpp": table}}).engines.llamacpp

    # The operator's llama-server on each node: nothing to build.
    assert llamacpp({"version": ""}).build is None
    # Prebuilt archives of another release: the pinned source is not that release's, so no build.
    other = llamacpp({"version": "b9000", "archives": [archive]})
    assert other.build is None and len(other.archives) == 1
    # The pinned release from archives where they fit, built elsewhere; or built nowhere.
    assert llamacpp({"archives": [archive]}).build is not None
    assert llamacpp({"archives": [archive], "build": False}).build is None
    # Another release built from its own source.
    own = llamacpp({"version": "b9000", "build": {"url": "https://x/src.tar.gz", "sha256": "c" * 64, "jobs": 3}})
    assert own.build is not None and own.build.jobs == 3


def test_the_releases_llamacpp_is_the_default_and_what_a_table_names_keeps_to_it() -> None:
    archive = {"arch": "x86_64", "url": "https://x/a.tgz", "sha256": "b" * 64, "binary": "bin/llama-server"}

    def llamacpp(table: dict) -> config.LlamacppSource:
        return config.server_config_from_dict({"engines": {"llamacpp": table}}).engines.llamacpp

    assert config.LlamacppSource().release and llamacpp({}).release
    assert llamacpp({"version": pins.LLAMACPP_VERSION}).release
    assert llamacpp({"build": False}).release  # build nowhere: the release's prebuilt one still serves
    assert not llamacpp({"archives": [archive]}).release  # its own archives, as before
    assert not llamacpp({"build": {"url": "https://x/src.tar.gz", "sha256": "c" * 64}}).release
    assert llamacpp({"archives": [archive], "release": True}).release and not llamacpp({"release": False}).release
    # The release carries the pinned version: with only the release to come from, that version is enough...
    assert llamacpp({"build": False}).build is None
    # ...and another needs a source of its own.
    assert problems_of({"engines": {"llamacpp": {"version": "b9000", "build": False, "release": True}}})[0].startswith(
        "version 'b9000' needs `archives` or `build`"
    )
    assert problems_of({"engines": {"llamacpp": {"build": False, "release": False}}})[0].startswith(
        f"version '{pins.LLAMACPP_VERSION}' needs `archives` or `build`"
    )


def test_a_build_is_checked_and_named_with_its_path() -> None:
    assert problems_of({"engines": {"llamacpp": {"version": "b9000"}}}) == [
        "version 'b9000' needs `archives` or `build` or `pip` to install it from, or version = \"\" to use the "
        "engine the operator installed on each node @ $.engines.llamacpp"
    ]
    bad = {"version": "", "build": {"url": "ftp://x", "sha256": "C" * 64, "jobs": -1, "timeout_s": 0}}
    problems = problems_of({"engines": {"llamacpp": bad}})
    assert any("nothing to build" in p and p.endswith("@ $.engines.llamacpp.build") for p in problems)
    for key in ("url", "sha256", "jobs", "timeout_s"):
        assert any(p.endswith(f"@ $.engines.llamacpp.build.{key}") for p in problems), key
    assert problems_of({"engines": {"llamacpp": {"build": "yes"}}}) == [
        "expected a table (url, sha256, ...) or false, got str 'yes' @ $.engines.llamacpp.build"
    ]
    assert problems_of({"engines": {"vllm": {"version": "1", "pip": "vllm==1", "build": False}}})[0].startswith(
        "unknown key 'build'"
    )
    assert problems_of({"server": "wss://x:1", "build_jobs": -1, "build_cache": "rel"}, kind="agent") == [
        "must not be negative (0: automatic), got -1 @ $.build_jobs",
        "build_cache must be an absolute path, got 'rel' @ $.build_cache",
    ]


def test_the_driver_paths_in_agent_toml_are_absolute() -> None:
    # The agent runs from / under systemd: a relative nvidia_smi would be found nowhere, and the
    # node would register with no GPUs.
    given = {"server": "wss://x:1", "nvidia_smi": "bin/nvidia-smi", "ib_root": "sys/ib", "sminfo": "/usr/sbin/sminfo"}
    assert problems_of(given, kind="agent") == [
        "nvidia_smi must be an absolute path, got 'bin/nvidia-smi' @ $.nvidia_smi",
        "ib_root must be an absolute path, got 'sys/ib' @ $.ib_root",
    ]


def test_the_weights_cache_limit_is_a_size_zero_or_more() -> None:
    cfg = config.agent_config_from_dict({"server": "wss://x:1", "weights_cache_gib": 1.5})
    assert config.weights_cache_bytes_of(cfg) == 3 << 29
    assert config.weights_cache_bytes_of(config.agent_config_from_dict({"server": "wss://x:1"})) == 0
    for bad in (-1, float("nan"), float("inf")):
        assert problems_of({"server": "wss://x:1", "weights_cache_gib": bad}, kind="agent") == [
            f"must be a size in GiB, 0 or more (0: no limit but the disk's), got {float(bad)} @ $.weights_cache_gib"
        ]


def test_page_origins_are_origins_each_refused_with_its_index() -> None:
    good = config.server_config_from_dict({"server": {"page_origins": ["http://127.0.0.1:9000", "https://cp.example"]}})
    assert good.server.page_origins == ("http://127.0.0.1:9000", "https://cp.example")
    bad = ["http://cp.example", "https://cp.example/page", "cp.example:80", "http://cp.example:70000"]
    problems = problems_of({"server": {"page_origins": bad}})
    assert [p.rsplit(" @ ", 1)[1] for p in problems] == [f"$.server.page_origins[{i}]" for i in (1, 2, 3)]
    assert "'https://cp.example/page'" in problems[0] and "http://HOST[:PORT]" in problems[0]


def test_llamacpp_measure_speed_is_on_by_default_and_a_bool() -> None:
    assert config.server_config_from_dict({}).engines.llamacpp.measure_speed
    off = config.server_config_from_dict({"engines": {"llamacpp": {"measure_speed": False}}}).engines.llamacpp
    assert not off.measure_speed and off.version == pins.LLAMACPP_VERSION and off.release  # nothing else moves
    assert any(
        "$.engines.llamacpp.measure_speed" in p for p in problems_of({"engines": {"llamacpp": {"measure_speed": "no"}}})
    )


def test_a_llamacpp_model_may_span_several_nodes_and_needs_at_least_one() -> None:
    model = {"name": "big", "engine": "llamacpp", "source": {"path": "/models/big.gguf"}}
    [big] = config.server_config_from_dict(
        {"models": [{**model, "nodes_per_replica": 3, "gpus_per_replica": 1}]}
    ).models
    assert (big.engine, big.nodes_per_replica) == ("llamacpp", 3)
    assert problems_of({"models": [{**model, "nodes_per_replica": 0}]}) == [
        "must be at least 1 @ $.models[0].nodes_per_replica"
    ]
