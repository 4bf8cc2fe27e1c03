"""llmgw.hub.resolve against testlib.hubserver: a request becomes a catalog entry pinned to its
commit, with every file's SHA-256 (small files read, checked against their git blob id, and
hashed), sized from the GGUF headers (read in growing ranges) or config.json; whatever fails
raises and returns nothing."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from llmgw.errors import UsageError
from llmgw.hub import resolve as resolve_module
from llmgw.hub.client import HubClient, HubError
from llmgw.hub.files import FileChoiceError
from llmgw.hub.resolve import AddRequest, git_blob_id, resolve
from testlib.hubrepo import HubRepo
from testlib.hubrepos import gguf_repo, safetensors_files, safetensors_repo, split_gguf, tiny_gguf
from testlib.hubserver import HubServer

pytestmark = pytest.mark.trio

GGUF = "llmgw-tests/Tiny-Llama-GGUF"
ST = "llmgw-tests/tiny-llama"
TOKEN = "hf_resolve_token_1234"


@pytest.fixture
def hub() -> Iterator[HubServer]:
    repos = [
        gguf_repo(),
        safetensors_repo(),
        HubRepo("o/whole-q6", {"m-Q6_K.gguf": tiny_gguf(2)}),  # the split model, unsplit
        HubRepo("o/not-gguf", {"m-Q4_0.gguf": b"GGUF" + b"\xff" * 4000}),
        HubRepo("o/short", {"m-Q4_0.gguf": tiny_gguf(0)[:300]}),  # a header cut short
        HubRepo("o/readme", {"README.md": b"# nothing to serve\n"}),
        gguf_repo("o/gated", gated="manual", token=TOKEN),
    ]
    with HubServer(repos) as server:
        yield server


def client(hub: HubServer) -> HubClient:
    return HubClient(hub.url, timeout_s=10)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_a_gguf_repository_pinned_to_its_commit(hub: HubServer) -> None:
    resolved = await resolve(client(hub), AddRequest(name="tiny", hf=GGUF, quant="Q4_K_M"))
    model, estimate = resolved.model, resolved.estimate
    assert (model.name, model.engine, resolved.quant) == ("tiny", "llamacpp", "Q4_K_M")
    source = model.source
    assert (source.hf, source.revision, source.commit) == (GGUF, "main", hub.repos[GGUF].branches["main"])
    (f,) = source.files
    assert (f.path, f.size, f.sha256) == ("Tiny-Llama-Q4_K_M.gguf", len(tiny_gguf(0)), sha(tiny_gguf(0)))
    assert 0 < estimate.weights < estimate.total and estimate.gpus == 0
    assert model.memory_gb == pytest.approx(estimate.total / 2**30, abs=0.011)
    assert all(s.revision == source.commit for s in hub.log.requests(kind="resolve"))  # read at the pinned commit


async def test_a_split_quantisation_takes_every_part_and_sums_their_weights(hub: HubServer) -> None:
    resolved = await resolve(client(hub), AddRequest(name="tiny", hf=GGUF, quant="Q6_K"))
    parts = split_gguf(2)
    assert [(f.path, f.size, f.sha256) for f in resolved.model.source.files] == [
        (f"Tiny-Llama-Q6_K-0000{i}-of-00002.gguf", len(p), sha(p)) for i, p in enumerate(parts, start=1)
    ]
    whole = await resolve(client(hub), AddRequest(name="whole", hf="o/whole-q6"))
    assert resolved.estimate.weights == whole.estimate.weights > 0  # both parts' tensors, as one file's
    assert {s.path for s in hub.log.requests(kind="cdn")} >= {f.path for f in resolved.model.source.files}


async def test_a_safetensors_repository_is_a_directory_for_vllm(hub: HubServer) -> None:
    resolved = await resolve(client(hub), AddRequest(name="st", hf=ST))
    model, content = resolved.model, safetensors_files()
    assert model.engine == "vllm" and resolved.quant == ""
    assert [f.path for f in model.source.files] == [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    for f in model.source.files:  # the small files read and hashed here, the shards' from the Hub
        assert (f.size, f.sha256) == (len(content[f.path]), sha(content[f.path]))
    shards = len(content["model-00001-of-00002.safetensors"]) + len(content["model-00002-of-00002.safetensors"])
    assert resolved.estimate.weights <= shards < resolved.estimate.total
    assert hub.log.count(kind="cdn") == 0  # the shards' hashes come with the metadata: no shard is read
    sglang = await resolve(client(hub), AddRequest(name="st", hf=ST, engine="sglang", gpus_per_replica=1))
    assert sglang.model.engine == "sglang" and sglang.model.memory_gb == 0  # on a GPU: no node memory


async def test_a_commit_asked_for_stays_pinned_after_the_branch_moves(hub: HubServer) -> None:
    repo = hub.repos[GGUF]
    old = repo.branches["main"]
    repo.commit({"Tiny-Llama-Q4_K_M.gguf": tiny_gguf(5)})
    pinned = await resolve(client(hub), AddRequest(name="tiny", hf=GGUF, quant="Q4_K_M", revision=old))
    assert (pinned.model.source.revision, pinned.model.source.commit) == (old, old)
    assert pinned.model.source.files[0].sha256 == sha(tiny_gguf(0))
    now = await resolve(client(hub), AddRequest(name="tiny", hf=GGUF, quant="Q4_K_M"))
    assert now.model.source.commit == repo.branches["main"] != old
    assert now.model.source.files[0].sha256 == sha(tiny_gguf(5))


async def test_a_corrupt_small_file_is_a_hub_error(hub: HubServer) -> None:
    hub.faults.corrupt("config.json", at=3)
    with pytest.raises(HubError) as corrupt:
        await resolve(client(hub), AddRequest(name="st", hf=ST))
    assert "config.json" in str(corrupt.value) and "blob id" in str(corrupt.value)
    assert (await resolve(client(hub), AddRequest(name="st", hf=ST))).model.source.files  # once: then whole


async def test_a_small_file_cut_short_is_a_hub_error(hub: HubServer) -> None:
    hub.faults.cut("tokenizer.json", after=100)
    with pytest.raises(HubError, match="tokenizer.json.*try again"):
        await resolve(client(hub), AddRequest(name="st", hf=ST))


async def test_the_gguf_header_is_read_in_growing_ranges(hub: HubServer, monkeypatch: pytest.MonkeyPatch) -> None:
    whole = await resolve(client(hub), AddRequest(name="tiny", hf=GGUF, quant="Q8_0"))
    hub.log.clear()
    monkeypatch.setattr(resolve_module, "FIRST_READ", 64)
    ranged = await resolve(client(hub), AddRequest(name="tiny", hf=GGUF, quant="Q8_0"))
    assert ranged.estimate == whole.estimate
    reads = hub.log.requests(kind="cdn", path="Tiny-Llama-Q8_0.gguf")
    ends = [int(s.range.rsplit("-", 1)[1]) + 1 for s in reads if s.range]
    assert len(ends) >= 2 and ends == sorted(set(ends)) and ends[0] == 64  # each read larger than the last
    assert hub.log.bytes_sent("Tiny-Llama-Q8_0.gguf") < 4 * ends[-1]


@pytest.mark.parametrize(("repo", "said"), [("o/not-gguf", "not a GGUF"), ("o/short", "cut short")])
async def test_a_gguf_that_cannot_be_sized_is_a_hub_error(hub: HubServer, repo: str, said: str) -> None:
    with pytest.raises(HubError, match=said) as failed:
        await resolve(client(hub), AddRequest(name="m", hf=repo))
    assert "--memory-gb" in str(failed.value)


async def test_a_quant_that_is_not_there_names_those_that_are(hub: HubServer) -> None:
    with pytest.raises(FileChoiceError) as unknown:
        await resolve(client(hub), AddRequest(name="tiny", hf=GGUF, quant="IQ2_XS"))
    assert "no IQ2_XS quantisation; it has Q4_K_M, Q6_K, Q8_0" in str(unknown.value)
    with pytest.raises(FileChoiceError) as several:
        await resolve(client(hub), AddRequest(name="tiny", hf=GGUF))
    assert f"{GGUF} holds 3 GGUF models" in str(several.value) and "Tiny-Llama-Q8_0.gguf" in str(several.value)
    with pytest.raises(FileChoiceError) as pattern:
        await resolve(client(hub), AddRequest(name="tiny", hf=GGUF, file="*.bin"))
    assert "'*.bin' matches no GGUF model" in str(pattern.value) and "Tiny-Llama-Q4_K_M.gguf" in str(pattern.value)
    assert hub.log.count(kind="resolve") == 0  # refused before a file was read


async def test_a_repository_with_no_model_and_a_bad_name(hub: HubServer) -> None:
    with pytest.raises(UsageError, match="neither GGUF files"):
        await resolve(client(hub), AddRequest(name="m", hf="o/readme"))
    with pytest.raises(UsageError, match="ORG/NAME"):
        await resolve(client(hub), AddRequest(name="m", hf="../etc"))
    with pytest.raises(FileChoiceError, match="--engine vllm"):
        await resolve(client(hub), AddRequest(name="m", hf=ST, engine="llamacpp"))


async def test_a_gated_repository_resolves_with_its_token(hub: HubServer) -> None:
    from llmgw.config import Secret
    from llmgw.hub.client import GatedRepository

    with pytest.raises(GatedRepository):
        await resolve(client(hub), AddRequest(name="g", hf="o/gated", quant="Q8_0"))
    resolved = await resolve(client(hub).with_token(Secret(TOKEN)), AddRequest(name="g", hf="o/gated", quant="Q8_0"))
    assert resolved.model.source.files[0].sha256 == sha(tiny_gguf(1))


async def test_sizing_reads_the_args_and_the_gpus(hub: HubServer) -> None:
    small = await resolve(client(hub), AddRequest(name="t", hf=GGUF, quant="Q8_0", args=("--ctx-size", "256")))
    large = await resolve(client(hub), AddRequest(name="t", hf=GGUF, quant="Q8_0", args=("--ctx-size", "2048")))
    assert small.estimate.kv_cache < large.estimate.kv_cache and small.estimate.weights == large.estimate.weights
    with pytest.raises(UsageError):
        await resolve(client(hub), AddRequest(name="t", hf=GGUF, quant="Q8_0", args=("--ctx-size", "many")))
    gpu = await resolve(client(hub), AddRequest(name="t", hf=GGUF, quant="Q8_0", gpus_per_replica=2))
    assert gpu.estimate.gpus == 2 and gpu.model.memory_gb == 0


async def test_a_llamacpp_replica_over_several_nodes_asks_each_for_its_share(hub: HubServer) -> None:
    whole = await resolve(client(hub), AddRequest(name="t", hf=GGUF, quant="Q8_0"))
    split = await resolve(client(hub), AddRequest(name="t", hf=GGUF, quant="Q8_0", nodes_per_replica=3))
    e = split.estimate
    assert split.model.nodes_per_replica == 3 and e == whole.estimate
    # Each member's share of the layers and their cache (ceil(layers / 3) of them), the tensors
    # outside the layers, and its own buffers and process.
    assert e.layers > 0 and 0 < e.layer_bytes < e.weights
    most = -(-e.layers // 3)
    layers = (e.layer_bytes + e.kv_cache) * most / e.layers
    share = layers + e.weights - e.layer_bytes + e.compute + e.output + e.overhead
    assert split.model.memory_gb == pytest.approx(share / 2**30, abs=0.011)
    # Not the whole over three (0.02 GiB for this tiny model): each member has its buffers and process.
    assert split.model.memory_gb != pytest.approx(e.total / 3 / 2**30, abs=0.011)
    on_gpus = await resolve(
        client(hub), AddRequest(name="t", hf=GGUF, quant="Q8_0", nodes_per_replica=2, gpus_per_replica=1)
    )
    assert on_gpus.estimate.gpus == 2 and on_gpus.model.memory_gb == 0  # its share is on the GPUs (per_gpu)


async def test_an_empty_small_file_is_pinned(hub: HubServer) -> None:
    hub.add(HubRepo("o/st-empty", safetensors_files() | {"added_tokens.json": b""}))
    resolved = await resolve(client(hub), AddRequest(name="st", hf="o/st-empty"))
    (empty,) = (f for f in resolved.model.source.files if f.path == "added_tokens.json")
    assert (empty.size, empty.sha256) == (0, sha(b""))


async def test_git_blob_id_is_gits() -> None:
    assert git_blob_id(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"  # `git hash-object /dev/null`
    assert git_blob_id(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"
