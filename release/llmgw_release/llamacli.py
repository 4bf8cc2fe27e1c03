"""tools/llama/build-llama-server's command line: the portable llama.cpp from the cache.

    build-llama-server                  this machine's llama-server (built for this CPU and unpacked if need be); prints its path
    build-llama-server --cached         its path if it is there and runs (exit 0), else exit 3, building nothing
    build-llama-server --sdist          llama.cpp's pinned source (fetched once); prints its path
    build-llama-server --archive ARCH [--smoke GGUF]
                                        ARCH's release archive (built if need be), optionally smoke-tested
    build-llama-server --vulkan [--cached | --archive ARCH]
                                        the same for the Vulkan build (llamavulkan: the CPU build's files
                                        and llama.cpp's Vulkan module); native builds only

LLMGW_LLAMA_CACHE moves the cache (default ~/.cache/llmgw-llama); LLAMA_BUILD_JOBS sets the
compile jobs (default 2). `./pants test` runs it first (tools/testenv/prepare.py), with the
interpreter Pants runs on: standard library only, CPython 3.9+.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from llmgw.llamarecipe import ARCHES, RecipeError
from llmgw_release import llamabuild, llamasmoke, llamavulkan
from llmgw_release.llamabuild import LlamaBuildError, stderr_say

NOT_BUILT = 3  # `--cached`: nothing in the cache


def build_jobs(env: Mapping[str, str] = os.environ) -> int:
    text = env.get("LLAMA_BUILD_JOBS", str(llamabuild.DEFAULT_JOBS))
    if not text.isdigit() or int(text) < 1:
        raise LlamaBuildError(f"LLAMA_BUILD_JOBS must be a positive number, not {text!r}")
    return int(text)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build-llama-server",
        description=(
            "The portable llama.cpp (llmgw.pins' source, $ORIGIN library paths), built once into the cache "
            "($LLMGW_LLAMA_CACHE, default ~/.cache/llmgw-llama). Without options: this machine's llama-server "
            "(its CPU's variants: the baseline and the one it loads), unpacked from its archive; prints its "
            "path. --archive: an architecture's release archive, every CPU variant."
        ),
        allow_abbrev=False,
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--cached", action="store_true", help="print the llama-server's path if built, else exit 3")
    what.add_argument("--sdist", action="store_true", help="fetch llama.cpp's source if needed; print its path")
    what.add_argument("--archive", choices=ARCHES, help="build (if needed) this architecture's archive")
    parser.add_argument("--smoke", type=Path, metavar="GGUF", help="with --archive: run it, with one completion")
    parser.add_argument(
        "--vulkan",
        action="store_true",
        help="the Vulkan build instead (the CPU build's files and libggml-vulkan.so; built on top of the CPU build)",
    )
    args = parser.parse_args(argv)
    if args.smoke and not args.archive:
        parser.error("--smoke goes with --archive")
    if args.vulkan and args.sdist:
        parser.error("--vulkan goes with --cached, --archive or nothing")
    try:
        source, root = llamabuild.pinned_source(), llamabuild.cache_root()
        if args.vulkan:
            return _vulkan(args, source, root)
        if args.cached:
            server = llamabuild.cached_server(source, root)
            if server is None:
                return NOT_BUILT
            print(server)
        elif args.sdist:
            print(llamabuild.fetch_sdist(source, root))
        elif args.archive:
            recipe = llamabuild.make_recipe(source, args.archive)
            path = llamabuild.ensure_archive(recipe, root, jobs=build_jobs())
            if args.smoke:
                smoked = llamasmoke.smoke(path, source, args.archive, model=args.smoke)
                stderr_say(f"{path.name}: {smoked.version}; loaded {smoked.backend}; wrote {smoked.completion!r}")
            print(path)
        else:
            print(llamabuild.ensure_server(source, root, jobs=build_jobs()))
    except (LlamaBuildError, RecipeError) as exc:
        stderr_say(str(exc))
        return 1
    return 0


def _vulkan(args: argparse.Namespace, source: llamabuild.Source, root: Path) -> int:
    if args.cached:
        server = llamavulkan.cached_server(source, root)
        if server is None:
            return NOT_BUILT
        print(server)
    elif args.archive:
        recipe = llamavulkan.make_recipe(source, args.archive)
        path = llamavulkan.ensure_archive(recipe, root, jobs=build_jobs())
        if args.smoke:
            smoked = llamasmoke.smoke(path, source, args.archive, model=args.smoke, top=llamavulkan.top_dir(recipe))
            stderr_say(f"{path.name}: {smoked.version}; loaded {smoked.backend}; wrote {smoked.completion!r}")
        print(path)
    else:
        print(llamavulkan.ensure_server(source, root, jobs=build_jobs()))
    return 0
