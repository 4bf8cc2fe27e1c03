"""llmgw.hub.files: which of a repository's files each engine takes (pure: names in, a choice or a
FileChoiceError naming what is there out)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.hub.client import HubFile
from llmgw.hub.files import Choice, FileChoiceError, choose, default_engine, gguf_choices, quant_of

MIB = 1 << 20


def files(*names: str, size: int = MIB) -> list[HubFile]:
    return [
        HubFile(path=n, size=size, sha256="ab" * 32 if n.endswith((".gguf", ".safetensors")) else "") for n in names
    ]


def paths(choice: Choice) -> list[str]:
    return [f.path for f in choice.files]


@pytest.mark.parametrize(
    ("name", "quant"),
    [
        ("Qwen3-0.6B-Q8_0.gguf", "Q8_0"),
        ("Llama-3.2-1B-Instruct-Q4_K_M.gguf", "Q4_K_M"),
        ("model.IQ4_XS.gguf", "IQ4_XS"),
        ("Llama-3.2-1B-Instruct-f16.gguf", "F16"),
        ("gemma-3-27b-it-BF16-00001-of-00002.gguf", "BF16"),
        ("Qwen3-30B-A3B-UD-Q4_K_XL.gguf", "UD-Q4_K_XL"),
        ("sub/dir/m-q5_k_s.gguf", "Q5_K_S"),
        ("gpt-oss-20b-MXFP4.gguf", "MXFP4"),
        ("model.gguf", ""),
        ("Qwen3-8B.gguf", ""),
    ],
)
def test_quant_of(name: str, quant: str) -> None:
    assert quant_of(name) == quant


def test_a_repository_of_one_gguf_needs_no_quant() -> None:
    choice = choose(files("README.md", "model-Q4_K_M.gguf", ".gitattributes"), "llamacpp", repo="o/m")
    assert paths(choice) == ["model-Q4_K_M.gguf"] and choice.quant == "Q4_K_M" and choice.size == MIB


def test_several_quantisations_are_an_error_listing_them() -> None:
    repo = files("m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-Q6_K-00001-of-00002.gguf", "m-Q6_K-00002-of-00002.gguf")
    with pytest.raises(FileChoiceError) as ambiguous:
        choose(repo, "llamacpp", repo="o/m")
    message = str(ambiguous.value)
    assert "o/m holds 3 GGUF models" in message and "--quant" in message
    for listed in ("m-Q4_K_M.gguf", "m-Q8_0.gguf", "m-Q6_K-00001-of-00002.gguf (+1 parts)", "[Q6_K, 2.0 MiB]"):
        assert listed in message
    assert paths(choose(repo, "llamacpp", quant="q8_0")) == ["m-Q8_0.gguf"]  # any case
    split = choose(repo, "llamacpp", quant="Q6_K")
    assert paths(split) == ["m-Q6_K-00001-of-00002.gguf", "m-Q6_K-00002-of-00002.gguf"] and split.size == 2 * MIB


def test_split_parts_are_ordered_and_an_incomplete_set_is_no_model() -> None:
    parts = [f"m-Q4_K_M-{i:05d}-of-00003.gguf" for i in (3, 1, 2)]
    assert paths(choose(files(*parts), "llamacpp")) == sorted(parts)
    with pytest.raises(FileChoiceError, match="no GGUF file"):
        choose(files(*parts[:2]), "llamacpp", repo="o/m")  # part 3 is missing
    with_whole = files(*parts[:2], "m-Q8_0.gguf")
    assert paths(choose(with_whole, "llamacpp")) == ["m-Q8_0.gguf"]  # the incomplete set is not counted
    with pytest.raises(FileChoiceError, match="no Q4_K_M quantisation; it has Q8_0"):
        choose(with_whole, "llamacpp", quant="Q4_K_M", repo="o/m")


def test_two_split_sets_of_different_counts_are_two_models() -> None:
    repo = files("a-Q4_0-00001-of-00002.gguf", "a-Q4_0-00002-of-00002.gguf", "a-Q4_0-00001-of-00001.gguf")
    assert sorted(len(c.files) for c in gguf_choices(repo)) == [1, 2]


def test_projectors_are_not_models() -> None:
    repo = files("mmproj-model-f16.gguf", "MMPROJ-Q8_0.gguf", "gemma-3-4b-it-Q4_K_M.gguf")
    assert paths(choose(repo, "llamacpp")) == ["gemma-3-4b-it-Q4_K_M.gguf"]
    with pytest.raises(FileChoiceError, match="no GGUF file"):
        choose(files("mmproj-model-f16.gguf"), "llamacpp", repo="o/m")


def test_file_patterns() -> None:
    repo = files("m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf", "sub/m-Q2_K.gguf")
    assert paths(choose(repo, "llamacpp", pattern="*Q8_0*")) == ["m-Q8_0.gguf"]
    assert paths(choose(repo, "llamacpp", pattern="m-Q2_K.gguf")) == ["sub/m-Q2_K.gguf"]  # by base name too
    assert paths(choose(repo, "llamacpp", pattern="sub/*")) == ["sub/m-Q2_K.gguf"]
    with pytest.raises(FileChoiceError) as two:
        choose(repo, "llamacpp", pattern="*Q4_K_*", repo="o/m")
    assert "2 GGUF models matching" in str(two.value) and "m-Q4_K_S.gguf" in str(two.value)
    assert paths(choose(repo, "llamacpp", pattern="*Q4_K_*", quant="Q4_K_S")) == ["m-Q4_K_S.gguf"]
    with pytest.raises(FileChoiceError) as none:
        choose(repo, "llamacpp", pattern="*IQ1*", repo="o/m")
    assert "'*IQ1*' matches no GGUF model in o/m" in str(none.value) and "m-Q8_0.gguf" in str(none.value)
    split = files("m-00001-of-00002.gguf", "m-00002-of-00002.gguf", "n.gguf")
    assert len(choose(split, "llamacpp", pattern="*00002-of*").files) == 2  # a part names its whole set


VLLM_REPO = files(
    "README.md",
    ".gitattributes",
    "config.json",
    "generation_config.json",
    "model-00002-of-00002.safetensors",
    "model-00001-of-00002.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "original/consolidated.safetensors",
    "original/params.json",
    "LICENSE",
)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_directory_for_vllm_and_sglang(engine: str) -> None:
    choice = choose(VLLM_REPO, engine, repo="o/m")
    assert paths(choice) == [
        "config.json",
        "generation_config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert choice.quant == "" and default_engine(VLLM_REPO) == "vllm"
    assert paths(choose(VLLM_REPO, engine, pattern="*00001*"))[-1] == "model-00001-of-00002.safetensors"


def test_mistral_consolidated_weights_beside_the_shards_are_left_out() -> None:
    """Mistral's repos hold their own consolidated.safetensors beside transformers' shards: the
    same weights twice, which vLLM does not load (the index names the shards)."""
    repo = files("config.json", "consolidated.safetensors", "model-00001-of-00001.safetensors", "params.json")
    assert paths(choose(repo, "vllm")) == ["config.json", "model-00001-of-00001.safetensors"]
    alone = files("config.json", "consolidated.safetensors")  # the only weights there are: taken
    assert paths(choose(alone, "vllm")) == ["config.json", "consolidated.safetensors"]


def test_a_directory_needs_config_json_and_top_level_shards() -> None:
    with pytest.raises(FileChoiceError, match="no config.json"):
        choose(files("model.safetensors", "tokenizer.json"), "vllm", repo="o/m")
    with pytest.raises(FileChoiceError, match="no safetensors weights at its top level"):
        choose(files("config.json", "original/model.safetensors"), "vllm", repo="o/m")
    with pytest.raises(FileChoiceError, match="'x\\*' matches no safetensors"):
        choose(VLLM_REPO, "vllm", pattern="x*", repo="o/m")


def test_the_wrong_engine_for_the_repository_says_which_to_use() -> None:
    gguf = files("m-Q4_K_M.gguf", "README.md")
    with pytest.raises(FileChoiceError) as for_vllm:
        choose(gguf, "vllm", repo="o/m-GGUF")
    assert "o/m-GGUF" in str(for_vllm.value) and "--engine llamacpp" in str(for_vllm.value)
    with pytest.raises(FileChoiceError) as for_llama:
        choose(VLLM_REPO, "llamacpp", repo="o/m")
    assert "no GGUF file" in str(for_llama.value) and "--engine vllm" in str(for_llama.value)
    with pytest.raises(FileChoiceError, match="--quant picks one of a repository's GGUF"):
        choose(VLLM_REPO, "vllm", quant="Q4_K_M", repo="o/m")
    with pytest.raises(FileChoiceError, match="engine 'simengine' takes no files"):
        choose(gguf, "simengine")


def test_default_engine() -> None:
    assert default_engine(files("m-Q4_K_M.gguf", "model.safetensors")) == "llamacpp"  # GGUF first
    assert default_engine(files("README.md", "original/model.safetensors")) == ""
    assert default_engine(files("mmproj-f16.gguf")) == ""
    assert default_engine([]) == ""


NAME_PARTS = st.sampled_from(
    ["m", "Q4_K_M", "q8_0", "UD-Q4_K_XL", "mmproj", "00001-of-00002", "00002-of-00002", "00000-of-00000",
     "00001-of-00001", "f16", "model", "sub/", "../", "-", "_", ".", "config", "tokenizer", "original/"]
)  # fmt: skip
SUFFIXES = st.sampled_from([".gguf", ".GGUF", ".safetensors", ".json", "", ".md"])
NAMES = st.one_of(
    st.builds(lambda parts, suffix: "".join(parts) + suffix, st.lists(NAME_PARTS, min_size=1, max_size=5), SUFFIXES),
    st.text(min_size=1, max_size=40),
)


@given(
    names=st.lists(NAMES, max_size=12, unique=True),
    engine=st.sampled_from(["llamacpp", "vllm", "sglang", "other"]),
    pattern=st.sampled_from(["", "*", "*Q4*", "[", "*.gguf", "sub/*"]),
    quant=st.sampled_from(["", "Q4_K_M", "q8_0", "F16"]),
)
def test_any_names_give_a_choice_from_them_or_a_file_choice_error(
    names: list[str], engine: str, pattern: str, quant: str
) -> None:
    repo = [HubFile(path=n, size=i, sha256="") for i, n in enumerate(names)]
    try:
        choice = choose(repo, engine, pattern=pattern, quant=quant, repo="o/m")
    except FileChoiceError as e:
        assert str(e)
        return
    assert choice.files and len(set(choice.files)) == len(choice.files)
    assert set(choice.files) <= set(repo)
    if engine == "llamacpp":
        assert all(f.path.lower().endswith(".gguf") for f in choice.files)
        assert not quant or choice.quant == quant.upper()
    else:
        assert choice.files[0].path == "config.json"
        assert any(f.path.endswith(".safetensors") and "/" not in f.path for f in choice.files)
