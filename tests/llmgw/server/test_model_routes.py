"""The admin API's body for adding a model from the Hub (`modelroutes.add_request`: every field
checked, a 400 naming the first wrong one, the token never echoed) and `capacity_refusal`, the
reason an add is refused before any write when no node or fabric could hold a replica."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.config import Model, Secret
from llmgw.http.errors import HTTPError
from llmgw.hub.resolve import AddRequest
from llmgw.server.admin.modelroutes import FIELDS, MAX_TEXT, MAX_TOKEN, add_request
from llmgw.server.admin.models import capacity_refusal
from llmgw.server.state.scheduler import NodeView

GIB = 1 << 30
SECRET = "hf_SECRET_never_shown_0123456789"

FULL = {
    "name": "qwen3-0.6b",
    "hf": "Qwen/Qwen3-0.6B-GGUF",
    "revision": "main",
    "file": "*Q8_0*",
    "quant": "Q8_0",
    "engine": "llamacpp",
    "replicas": 2,
    "gpus_per_replica": 1,
    "nodes_per_replica": 1,
    "memory_gb": 1.5,
    "args": ["--ctx-size", "4096"],
    "routing": "prefix",
    "token": SECRET,
}


def refused(body: Any) -> str:
    with pytest.raises(HTTPError) as caught:
        add_request(body)
    assert caught.value.status == 400
    message = str(caught.value.args[1] if len(caught.value.args) > 1 else caught.value)
    assert SECRET not in message and SECRET not in str(caught.value)
    return message


def test_a_full_body() -> None:
    req, token = add_request(dict(FULL))
    assert req == AddRequest(
        name="qwen3-0.6b",
        hf="Qwen/Qwen3-0.6B-GGUF",
        revision="main",
        file="*Q8_0*",
        quant="Q8_0",
        engine="llamacpp",
        replicas=2,
        gpus_per_replica=1,
        nodes_per_replica=1,
        memory_gb=1.5,
        args=("--ctx-size", "4096"),
        routing="prefix",
    )
    assert isinstance(token, Secret) and token.reveal() == SECRET and SECRET not in repr(req)
    assert set(FULL) == FIELDS


def test_the_least_body_takes_the_defaults() -> None:
    req, token = add_request({"name": "m", "hf": "o/m"})
    assert req == AddRequest(name="m", hf="o/m") and token is None
    assert add_request({"name": "m", "hf": "o/m", "token": ""})[1] is None
    assert add_request({"name": "m", "hf": "o/m", "memory_gb": 2})[0].memory_gb == 2.0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"name": ""}, "'name'"),
        ({"name": 5}, "'name'"),
        ({"name": None}, "'name'"),
        ({"name": "a/b"}, "model name 'a/b'"),
        ({"name": "-x"}, "model name"),
        ({"name": "x" * 64}, "model name"),
        ({"hf": ""}, "'hf'"),
        ({"hf": ["o/m"]}, "'hf'"),
        ({"hf": "o/" + "m" * MAX_TEXT}, "'hf' must be at most 200 characters"),
        ({"revision": 1}, "'revision' must be a string"),
        ({"file": None}, "'file' must be a string"),
        ({"quant": "Q" * (MAX_TEXT + 1)}, "'quant'"),
        ({"engine": {"x": 1}}, "'engine'"),
        ({"routing": False}, "'routing'"),
        ({"replicas": 0}, "'replicas' must be a whole number from 1 to 1000, got 0"),
        ({"replicas": 1001}, "'replicas'"),
        ({"replicas": True}, "'replicas'"),
        ({"replicas": 1.0}, "'replicas'"),
        ({"replicas": "2"}, "'replicas'"),
        ({"gpus_per_replica": -1}, "'gpus_per_replica'"),
        ({"gpus_per_replica": 65}, "'gpus_per_replica'"),
        ({"gpus_per_replica": False}, "'gpus_per_replica'"),
        ({"nodes_per_replica": 0}, "'nodes_per_replica'"),
        ({"nodes_per_replica": None}, "'nodes_per_replica'"),
        ({"memory_gb": -0.5}, "'memory_gb'"),
        ({"memory_gb": True}, "'memory_gb'"),
        ({"memory_gb": "1"}, "'memory_gb'"),
        ({"memory_gb": float("inf")}, "'memory_gb'"),
        ({"memory_gb": float("nan")}, "'memory_gb'"),
        ({"memory_gb": 2.0**21}, "'memory_gb'"),
        ({"args": "--ctx-size 4096"}, "'args'"),
        ({"args": [1]}, "'args'"),
        ({"args": ["x"] * 65}, "'args'"),
        ({"args": ["x" * 1001]}, "'args'"),
        ({"args": None}, "'args'"),
        ({"tokens": "x"}, "unknown fields ['tokens']"),
        ({"Name": "x", "extra": 1}, "unknown fields ['Name', 'extra']"),
    ],
)
def test_each_wrong_field_is_a_400_naming_it(change: dict[str, Any], named: str) -> None:
    assert named in refused(FULL | change)


@pytest.mark.parametrize("token", [5, [SECRET], {"t": SECRET}, SECRET * 200, None])
def test_a_wrong_token_is_refused_without_being_echoed(token: object) -> None:
    message = refused(FULL | {"token": token})
    assert "'token'" in message and "something else" in message
    assert len(SECRET * 200) > MAX_TOKEN


@pytest.mark.parametrize("body", [None, [], "x", 1, [FULL]])
def test_a_body_that_is_not_an_object(body: object) -> None:
    assert "JSON object" in refused(body)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
VALUES = JSON | st.sampled_from([SECRET, "o/m", "m", 1, 0, 64, 1000, 1.5, ["--x"], ""])
BODIES = st.dictionaries(st.sampled_from(sorted(FIELDS)) | st.text(max_size=8), VALUES, max_size=len(FIELDS) + 2)


@given(body=BODIES | JSON, with_token=st.booleans())
def test_any_json_is_a_request_or_a_400(body: Any, with_token: bool) -> None:
    if with_token and isinstance(body, dict):
        body = body | {"token": SECRET}
    try:
        req, token = add_request(body)
    except HTTPError as e:
        assert e.status == 400 and SECRET not in str(e) and SECRET not in repr(e.args)
        return
    assert isinstance(req, AddRequest) and req.name == body["name"] and req.hf == body["hf"]
    assert 1 <= req.replicas <= 1000 and 0 <= req.gpus_per_replica <= 64 and 1 <= req.nodes_per_replica <= 64
    assert token is None or token.reveal() == body["token"]


# -- capacity_refusal


def node(
    name: str, mem_gib: float, *, gpus: int = 0, gpu_gib: float = 0, fabrics: tuple[str, ...] = (), alive: bool = True
) -> NodeView:
    return NodeView(
        node_id=name,
        schedulable=True,
        engines=frozenset({"llamacpp", "vllm"}),
        gpus=gpus,
        memory_bytes=int(mem_gib * GIB),
        fabrics=fabrics,
        alive=alive,
        gpu_memory_bytes=int(gpu_gib * GIB),
    )


def model(memory_gb: float = 0.0, *, gpus: int = 0, nodes: int = 1) -> Model:
    return Model(name="m", engine="vllm", memory_gb=memory_gb, gpus_per_replica=gpus, nodes_per_replica=nodes)


def test_no_node_judges_nothing() -> None:
    assert capacity_refusal(model(1000), 0, []) == ""
    assert capacity_refusal(model(1000), 0, [node("n1", 1, alive=False)]) == ""  # only lost ones


def test_a_cpu_replica_larger_than_every_node() -> None:
    nodes = [node("n1", 8), node("n2", 16), node("gone", 512, alive=False)]
    assert capacity_refusal(model(16), 0, nodes) == ""
    reason = capacity_refusal(model(16.5), 0, nodes)
    assert "16.50 GiB of memory on one node" in reason and "the largest has 16.00 GiB" in reason
    assert "--quant" in reason and "--ctx-size" in reason and "--memory-gb" in reason


def test_a_gpu_replica_counts_gpus_and_their_memory() -> None:
    per_gpu = 20 * GIB
    small = [node("a", 64, gpus=2, gpu_gib=16), node("b", 64, gpus=1, gpu_gib=80)]
    reason = capacity_refusal(model(gpus=2), per_gpu, small)
    assert "2 GPUs of 20.00 GiB each" in reason and "the best has 2 GPUs of 16.00 GiB" in reason
    assert capacity_refusal(model(gpus=2), per_gpu, [*small, node("c", 64, gpus=4, gpu_gib=24)]) == ""
    assert capacity_refusal(model(gpus=2), per_gpu, [node("d", 64, gpus=2)]) == ""  # memory not reported: allowed
    assert "the best has 1 GPUs" in capacity_refusal(model(gpus=2), per_gpu, [node("e", 64, gpus=1, gpu_gib=80)])


def test_a_multi_node_replica_needs_enough_nodes_of_one_fabric() -> None:
    ib = ("ib@fabric-a",)
    two = [node("a", 32, fabrics=ib), node("b", 32, fabrics=ib)]
    assert capacity_refusal(model(20, nodes=2), 0, two) == ""
    split = [node("a", 32, fabrics=ib), node("b", 32, fabrics=("ib@fabric-b",)), node("c", 32)]
    reason = capacity_refusal(model(20, nodes=2), 0, split)
    assert "2 nodes of one fabric" in reason and "(20.00 GiB)" in reason and "at most 1 do" in reason
    assert "add nodes to that fabric" in reason and "--nodes-per-replica" in reason
    too_small = [node("a", 32, fabrics=ib), node("b", 16, fabrics=ib)]  # each must hold its share
    assert "at most 1 do" in capacity_refusal(model(20, nodes=2), 0, too_small)
    assert "at most 0 do" in capacity_refusal(model(20, nodes=2), 0, [node("a", 32), node("b", 32)])
    gpus = [node("a", 32, gpus=1, gpu_gib=24, fabrics=ib), node("b", 32, gpus=1, gpu_gib=24, fabrics=ib)]
    assert capacity_refusal(model(gpus=1, nodes=2), 20 * GIB, gpus) == ""
    assert "1 GPUs of 30.00 GiB); at most 0 do" in capacity_refusal(model(gpus=1, nodes=2), 30 * GIB, gpus)


def test_a_llamacpp_replica_over_several_nodes_may_use_one_subnet() -> None:
    llama = Model(name="m", engine="llamacpp", memory_gb=20, nodes_per_replica=2)
    subnet = [attrs.evolve(node(n, 32), subnet="subnet:10.0.0.0/24") for n in "ab"]
    assert capacity_refusal(llama, 0, subnet) == ""
    assert "at most 0 do" in capacity_refusal(model(20, nodes=2), 0, subnet)  # vLLM needs a fabric
    apart = [subnet[0], attrs.evolve(node("b", 32), subnet="subnet:10.0.1.0/24")]
    reason = capacity_refusal(llama, 0, apart)
    assert "2 nodes of one fabric or subnet" in reason and "at most 1 do" in reason
    assert "add nodes to that fabric or subnet" in reason
