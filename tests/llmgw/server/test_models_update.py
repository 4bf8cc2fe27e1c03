"""`llmgw ctl models update` on the control plane (`HubModels.update`, POST
/admin/v1/models/NAME/update): a model added from the Hub resolved again with another revision or
args, the rest as it was, written to the store and put in the catalog (a new version of it, which
its rollout replaces replica by replica); a server.toml model can only be retried; `--retry`
reaches the rollouts. On testlib's Hub server and a real store."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
import trio

from llmgw.config import ServerConfig, server_config_from_dict
from llmgw.errors import UsageError
from llmgw.hub.client import HubClient
from llmgw.hub.resolve import AddRequest
from llmgw.server.admin.modelroutes import update_request
from llmgw.server.admin.models import HubModels, UnknownModel
from llmgw.server.settings import Settings
from llmgw.server.state.changes import Changes
from llmgw.server.state.versions import version_of
from llmgw.server.store.asyncstore import AsyncStore
from llmgw.server.store.keyseal import KeySeal
from testlib.hubrepos import gguf_repo, tiny_gguf
from testlib.hubserver import HubServer
from testlib.stores import StoreUnderTest

pytestmark = pytest.mark.trio

REPO = "llmgw-tests/Tiny-GGUF"


class Passes:
    """The reconciler as the models see it: a pass, at once."""

    async def next_pass(self) -> set[str]:
        return set()


def models_on(tmp_path: Path, hub: HubServer, settings: Settings, retried: list[str]) -> HubModels:
    def retry(name: str) -> bool:
        retried.append(name)
        return True

    return HubModels(
        settings=settings,
        store=AsyncStore.open(tmp_path),
        key_seal=KeySeal(secrets.token_bytes(32)),
        changes=Changes(),
        reconciler=Passes(),  # type: ignore[arg-type]
        node_views=list,
        client=lambda: HubClient(hub.url, timeout_s=10),
        retry=retry,
    )


async def test_an_update_resolves_the_new_revision_and_keeps_the_rest(tmp_path: Path) -> None:
    repo = gguf_repo(REPO, model="Tiny")
    with HubServer([repo]) as hub:
        settings = Settings(ServerConfig())
        retried: list[str] = []
        models = models_on(tmp_path, hub, settings, retried)
        await models.add(AddRequest(name="tiny", hf=REPO, quant="Q8_0", replicas=3, args=("--ctx-size", "512")))
        first = settings.added["tiny"]
        # A new commit on a branch: the same quantisation, other bytes.
        v2 = await trio.to_thread.run_sync(lambda: repo.commit({"Tiny-Q8_0.gguf": tiny_gguf(7)}, branch="v2"))
        done = await models.update("tiny", revision="v2")
        second = settings.added["tiny"]
        assert done["changed"] is True and done["commit"] == v2 == second.source.commit
        assert second.source.files[0].path == "Tiny-Q8_0.gguf"
        assert second.source.files[0].sha256 != first.source.files[0].sha256
        assert (second.replicas, second.args, second.engine) == (3, ("--ctx-size", "512"), "llamacpp")
        assert version_of(second) != version_of(first)
        # Other args, the same revision: only the args change; the store has the new entry.
        done = await models.update("tiny", args=("--ctx-size", "1024"))
        third = settings.added["tiny"]
        assert done["changed"] is True and third.args == ("--ctx-size", "1024") and third.source == second.source
        [row] = await trio.to_thread.run_sync(models.store._store.hub_models)
        assert row.body["model"]["args"] == ["--ctx-size", "1024"] and row.body["quant"] == "Q8_0"
        # The same again: nothing to replace.
        assert (await models.update("tiny", args=("--ctx-size", "1024")))["changed"] is False
        assert (await models.update("tiny", retry=True))["retried"] is True and retried == ["tiny"]
        models.store.close()


async def test_what_an_update_refuses(tmp_path: Path) -> None:
    with HubServer([gguf_repo(REPO, model="Tiny")]) as hub:
        settings = Settings(server_config_from_dict({"models": [{"name": "chat", "engine": "sim"}]}))
        retried: list[str] = []
        models = models_on(tmp_path, hub, settings, retried)
        with pytest.raises(UsageError, match=r"chat is in server.toml's \[\[models\]\]: change it there"):
            await models.update("chat", args=("--x",))
        assert (await models.update("chat", retry=True))["retried"] is True and retried == ["chat"]
        with pytest.raises(UnknownModel, match="the catalog has no model nothing"):
            await models.update("nothing", retry=True)
        await models.add(AddRequest(name="tiny", hf=REPO, quant="Q8_0"))
        with pytest.raises(UsageError, match="say what to change"):
            await models.update("tiny")
        with pytest.raises(UsageError, match="--args sets --port, which llmgw sets itself"):
            await models.update("tiny", args=("--port", "1"))
        models.store.close()


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ([], "must be a JSON object"),
        ({"revision": 3}, "'revision' must be a string"),
        ({"args": "x"}, "'args' must be a list"),
        ({"retry": "yes"}, "'retry' must be true or false"),
        ({"replicas": 2}, "unknown fields ['replicas']"),
    ],
)
async def test_the_update_route_reads_its_body_strictly(body: Any, named: str) -> None:
    from llmgw.http.errors import HTTPError

    with pytest.raises(HTTPError) as info:
        update_request(body)
    assert info.value.status == 400 and named in str(info.value)


async def test_the_update_route_takes_each_field() -> None:
    assert update_request({"revision": "v2", "engine": "vllm", "args": ["-c", "8"], "retry": True}) == {
        "revision": "v2",
        "engine": "vllm",
        "args": ("-c", "8"),
        "retry": True,
    }
    assert update_request({}) == {"revision": "", "engine": "", "retry": False}


async def test_an_updated_row_is_in_the_store_of_either_backend(store_backend: StoreUnderTest) -> None:
    from llmgw.server.store import HubModelRow

    store = store_backend.open()
    store.add_hub_model(HubModelRow(name="m", body={"model": {"name": "m"}}, added_at=1.0))
    assert store.update_hub_model(HubModelRow(name="m", body={"model": {"name": "m", "x": 1}}, added_at=9.0))
    assert not store.update_hub_model(HubModelRow(name="other", body={}, added_at=9.0))
    [row] = store.hub_models()
    assert row.body == {"model": {"name": "m", "x": 1}} and row.added_at == 1.0


async def test_the_route_on_a_served_control_plane(tmp_path: Path, nursery: trio.Nursery) -> None:
    """POST /admin/v1/models/NAME/update through the admin API as `llmgw ctl` sends it: a
    server.toml model can be retried, not changed; GET /admin/v1/models says its rollout (none)."""
    from llmgw.config import Model, ServerSection
    from llmgw.ctl.client import AdminClient
    from llmgw.errors import PeerError
    from llmgw.server.app import ControlPlane
    from testlib.controlplane import OFFLINE_ENGINES, make_state

    state = tmp_path / "cp"
    make_state(state)
    config = ServerConfig(
        engines=OFFLINE_ENGINES,
        server=ServerSection(state_dir=str(state), agent_listen="127.0.0.1:0", http_listen="127.0.0.1:0"),
        models=(Model(name="chat", engine="sim"),),
    )
    plane = ControlPlane.open(config, state)
    await nursery.start(plane.serve)
    client = AdminClient.locate(server=None, credential=None, state_dir=str(state))

    def ask(method: str, path: str, body: Any = None) -> Any:
        return client.request(method, path, body)

    answer = await trio.to_thread.run_sync(ask, "POST", "/admin/v1/models/chat/update", {"retry": True})
    assert (answer["model"], answer["retried"], answer["changed"]) == ("chat", False, False)
    with pytest.raises(PeerError, match=r"chat is in server.toml's \[\[models\]\]: change it there.*HTTP 400"):
        await trio.to_thread.run_sync(ask, "POST", "/admin/v1/models/chat/update", {"args": ["--x"]})
    with pytest.raises(PeerError, match="unknown fields.*HTTP 400"):
        await trio.to_thread.run_sync(ask, "POST", "/admin/v1/models/chat/update", {"replicas": 3})
    [model] = (await trio.to_thread.run_sync(ask, "GET", "/admin/v1/models"))["models"]
    assert model["model"] == "chat" and model["rollout"] is None
