"""The control plane's view of fabrics: placed by (name, identity), with notes for the operator."""

from __future__ import annotations

from llmgw.fabrics import PlacementFabric, fabric_map, shared_fabrics
from llmgw.wire.agent_link import Fabric

SM_A = "ib-sm:0x0002c90300a1b2c3"
SM_B = "ib-sm:0x98039b0300c0ffee"


def fab(name: str, identity: str) -> Fabric:
    return Fabric(name=name, identity=identity, adapters=("mlx5_0", "mlx5_1"))


def test_one_name_on_two_subnet_managers_is_two_fabrics_and_says_so() -> None:
    m = fabric_map({"n1": [fab("ib-a", SM_A)], "n2": [fab("ib-a", SM_A)], "n3": [fab("ib-a", SM_B)]})
    assert m.fabrics == (
        PlacementFabric(name="ib-a", identity=SM_A, nodes=("n1", "n2")),
        PlacementFabric(name="ib-a", identity=SM_B, nodes=("n3",)),
    )
    [note] = m.notes
    assert note.startswith(
        f"fabric name 'ib-a' covers 2 independent fabrics (n1, n2 on {SM_A}; n3 on {SM_B}); they are placed as 2"
    )
    assert "Give each fabric its own name" in note
    assert [p.key for p in shared_fabrics(m, ["n1", "n2"])] == [f"ib-a@{SM_A}"]
    assert shared_fabrics(m, ["n1", "n3"]) == ()


def test_a_typo_in_a_name_merges_nothing() -> None:
    m = fabric_map({"n1": [fab("ib-a", SM_A)], "n2": [fab("ib_a", SM_A)]})
    assert shared_fabrics(m, ["n1", "n2"]) == ()
    [note] = m.notes
    assert note.startswith(f"fabric {SM_A} has 2 names (n1 call it 'ib-a'; n2 call it 'ib_a')")


def test_nodes_without_fabrics_are_islands_and_unverified_fabrics_do_not_count() -> None:
    m = fabric_map({"n1": [], "n2": [fab("ib-a", "")], "n3": [fab("ib-b", SM_B), fab("roce-1", "roce:10.0.0.0/24")]})
    assert [(p.name, p.nodes) for p in m.fabrics] == [("ib-b", ("n3",)), ("roce-1", ("n3",))]
    assert m.notes == ()
    assert shared_fabrics(m, ["n1"]) == ()
