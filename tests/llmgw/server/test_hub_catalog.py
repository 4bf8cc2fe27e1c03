"""The catalog's models added from the Hub as the control plane keeps them: in the store (either
backend; a standby cannot write them), merged with server.toml's (whose entry wins a shared
name), loaded at start with a gated repository's token opened from its seal."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest
import trio

from llmgw.config import Model, ModelFile, ModelSource, Secret, ServerConfig, server_config_from_dict, to_dict
from llmgw.errors import ConfigError, UsageError
from llmgw.server.admin.models import HubModels, UnknownModel
from llmgw.server.errors import NotLeader
from llmgw.server.settings import Settings
from llmgw.server.state.changes import Changes
from llmgw.server.state.weights import catalog_digests, weights_source
from llmgw.server.store import HubModelRow
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.server.store.keyseal import KeySeal
from testlib.postgres import Database
from testlib.stores import StoreUnderTest

COMMIT = "0123456789abcdef0123456789abcdef01234567"
DIGEST = "ab" * 32


def hub_model(name: str = "qwen", **kw: object) -> Model:
    source = ModelSource(
        hf="Qwen/Qwen3-0.6B-GGUF",
        revision="main",
        commit=COMMIT,
        files=(ModelFile(path="Qwen3-0.6B-Q8_0.gguf", size=639_447_744, sha256=DIGEST),),
    )
    return Model(name=name, engine="llamacpp", source=source, memory_gb=1.25, **kw)


def row(model: Model, sealed: str = "") -> HubModelRow:
    return HubModelRow(
        name=model.name,
        body={"model": to_dict(model), "estimate": {"total_bytes": 1}},
        sealed_token=sealed,
        added_at=5.0,
    )


def test_added_models_are_kept_by_the_store_and_read_at_open(store_backend: StoreUnderTest) -> None:
    store = store_backend.open()
    assert store.add_hub_model(row(hub_model())) is True
    assert store.add_hub_model(row(hub_model())) is False  # the name is taken
    store.close()
    store = store_backend.open()
    [kept] = store.hub_models()
    assert kept.name == "qwen" and kept.added_at == 5.0 and kept.body["model"]["source"]["commit"] == COMMIT
    store.close()
    opened = store_backend.open_async()
    try:
        assert [r.name for r in opened.at_open.hub_models] == ["qwen"]
    finally:
        opened.close()
    store = store_backend.open()
    assert store.remove_hub_model("qwen") is True and store.remove_hub_model("qwen") is False
    assert store.hub_models() == []
    store.close()


def test_a_standby_cannot_add_a_model(tmp_path: Path, postgres_db: Database) -> None:
    leader = AsyncStore.open(tmp_path / "leader", postgres_db.settings)  # migrates the schema
    leader.close()
    standby = AsyncStore.open_standby(tmp_path / "standby", postgres_db.settings)
    try:
        with pytest.raises(NotLeader):
            trio.run(standby.add_hub_model, row(hub_model()))
    finally:
        standby.close()


def test_server_toml_and_the_store_make_one_catalog_and_server_toml_wins_a_shared_name(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text('[[models]]\nname = "qwen"\nengine = "sim"\n')
    from llmgw.config import load_server_config

    settings = Settings(load_server_config(path), path)
    settings.set_added({"qwen": hub_model(), "other": hub_model("other")})
    assert [(m.name, m.engine) for m in settings.current.models] == [("qwen", "sim"), ("other", "llamacpp")]
    assert settings.shadowed() == ["qwen"]
    path.write_text('[[models]]\nname = "small"\nengine = "sim"\n')
    settings.reread()  # the added models stay; the shadow lifts
    assert [m.name for m in settings.current.models] == ["small", "other", "qwen"]
    assert settings.shadowed() == []


def test_server_toml_cannot_name_a_hub_source() -> None:
    with pytest.raises(ConfigError, match=r"llmgw ctl models add m --hf a/b.*@ \$\.models\[0\]\.source\.hf"):
        server_config_from_dict({"models": [{"name": "m", "engine": "llamacpp", "source": {"hf": "a/b"}}]})


def store_stub() -> AsyncStore:
    class Never:  # HubModels.load touches no store
        pass

    return Never()  # type: ignore[return-value]


def test_loading_opens_each_token_from_its_seal_and_skips_an_unreadable_row() -> None:
    seal = KeySeal(secrets.token_bytes(32))
    settings = Settings(ServerConfig())
    models = HubModels(
        settings=settings,
        store=store_stub(),
        key_seal=seal,
        changes=Changes(),
        reconciler=None,  # type: ignore[arg-type] - load pushes nothing
        node_views=list,
    )
    gated = hub_model("gated")
    rows = [
        row(gated, seal.seal("model:gated", "hf_secret")),
        row(hub_model("public")),
        HubModelRow(name="broken", body={"model": {"name": 3}}, added_at=1.0),
    ]
    models.load(rows)
    assert sorted(settings.added) == ["gated", "public"]
    token = settings.added["gated"].source.token
    assert isinstance(token, Secret) and token.reveal() == "hf_secret" and "hf_secret" not in repr(settings.added)
    assert settings.added["public"].source.token is None
    # What a node is told: the files at the pinned commit through [hub] endpoint, with the token.
    source = weights_source(settings.added["gated"], max_weights_bytes=0, hub=ServerConfig().hub)
    [f] = source.files
    assert f.url == f"https://huggingface.co/Qwen/Qwen3-0.6B-GGUF/resolve/{COMMIT}/Qwen3-0.6B-Q8_0.gguf"
    assert (source.token, source.commit, f.sha256, source.directory) == ("hf_secret", COMMIT, DIGEST, False)
    assert catalog_digests(settings.current.models) == (DIGEST,)
    view = models.detail([{"model": "gated"}, {"model": "sim-small"}])
    assert view[0]["from"] == "hub" and view[0]["token"] == "set" and "hf_secret" not in str(view)
    assert view[1] == {"model": "sim-small", "from": "server.toml", "staging_to": []}


def test_removing_names_where_a_model_comes_from() -> None:
    settings = Settings(server_config_from_dict({"models": [{"name": "from-file", "engine": "sim"}]}))
    models = HubModels(
        settings=settings,
        store=store_stub(),
        key_seal=KeySeal(secrets.token_bytes(32)),
        changes=Changes(),
        reconciler=None,  # type: ignore[arg-type]
        node_views=list,
    )
    with pytest.raises(UsageError, match=r"from-file is in server.toml's \[\[models\]\]; remove it there"):
        trio.run(models.remove, "from-file")
    with pytest.raises(UnknownModel, match="the catalog has no model nothing"):
        trio.run(models.remove, "nothing")


def test_search_says_for_each_choice_where_it_would_fit() -> None:
    from llmgw.hub.client import HubClient
    from llmgw.server.state.scheduler import GIB, NodeView
    from testlib.hubrepos import gguf_repo, safetensors_repo
    from testlib.hubserver import HubServer

    cpu = NodeView(node_id="cpu", schedulable=True, engines=frozenset({"llamacpp"}), gpus=0, memory_bytes=64 * GIB)
    small = NodeView(node_id="small", schedulable=True, engines=frozenset({"llamacpp"}), gpus=0, memory_bytes=1 << 20)
    gpu = NodeView(
        node_id="gpu",
        schedulable=True,
        engines=frozenset({"vllm"}),
        gpus=2,
        memory_bytes=8 * GIB,
        gpu_memory_bytes=24 * GIB,
    )
    with HubServer([gguf_repo("llmgw-tests/Tiny-GGUF"), safetensors_repo("llmgw-tests/tiny-llama")]) as hub:
        models = HubModels(
            settings=Settings(ServerConfig()),
            store=store_stub(),
            key_seal=KeySeal(secrets.token_bytes(32)),
            changes=Changes(),
            reconciler=None,  # type: ignore[arg-type] - a search changes nothing
            node_views=lambda: [cpu, small, gpu],
            client=lambda: HubClient(hub.url),
        )
        found = {r["repo"]: r for r in trio.run(models.search, "tiny")}
        with pytest.raises(UsageError, match="give some text to search for"):
            trio.run(models.search, " ")
    gguf = {c["quant"]: c for c in found["llmgw-tests/Tiny-GGUF"]["choices"]}
    assert set(gguf) == {"Q4_K_M", "Q8_0", "Q6_K"} and gguf["Q6_K"]["parts"] == 2
    assert all(c["engine"] == "llamacpp" and c["fits_on"] == ["cpu", "gpu"] for c in gguf.values())
    [st] = found["llmgw-tests/tiny-llama"]["choices"]
    assert st["engine"] == "vllm" and st["parts"] == 2 and st["fits_on"] == ["gpu"]
